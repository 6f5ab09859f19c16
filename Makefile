# Slipway: two set-up commands on a fresh machine — `make demo` and `make test` (both install first).
SHELL := /bin/bash
PYTHON ?= python3
# The local CPU build; a bare "torch" could pull a multi-GB CUDA wheel. Clusters bring their own torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := .make/install.stamp
CSRC := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.cpp csrc/cuda/*.h csrc/cuda/*.cuh)
DEVCLUSTER := slurm/devcluster
PYTEST_ARGS ?=

.PHONY: install mcore demo test test-fast test-stress lint bench cuda-check dev-image devcluster-up devcluster-down devcluster-status clean

install: $(STAMP)

# Idempotent: re-runs only when setup.py or the C++/CUDA sources change. Installs into the current
# environment (a cluster's container or conda env already has the right torch; see README).
$(STAMP): setup.py $(CSRC)
	@mkdir -p .make
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q setuptools wheel
	$(PYTHON) -m pip install -q --no-build-isolation -e '.[dev]'
	@$(PYTHON) -c "import torch, trainer._C" && echo "slipway installed; C++ extension trainer._C built"
	@touch $(STAMP)

# Real megatron-core releases side by side, the oracle of tests/mcore (versions: tests/mcore/versions.py),
# each in .make/mcore/<version> with --no-deps (they need only torch, numpy, packaging); an installed
# version is not downloaded again.
mcore: install
	$(PYTHON) -m tests.mcore.install

demo: install
	$(PYTHON) launch.py +experiment=codeparrot_smoke

# CUDA sources compile to objects with nvcc even on machines without a GPU (with the flags torch's
# CUDAExtension adds), so a CUDA syntax or type error fails `make test` everywhere nvcc exists. The
# torch-side bindings (csrc/cuda/*.cpp) are then type-checked with g++ -fsyntax-only: a CPU build of torch
# lacks c10/cuda/impl/cuda_cmake_macros.h, so an empty stand-in is searched last (-idirafter); a CUDA
# torch's own header wins where it exists.
cuda-check:
	@if command -v nvcc >/dev/null 2>&1 && ls csrc/cuda/*.cu >/dev/null 2>&1; then \
	  mkdir -p .make/cuda/stub/c10/cuda/impl && for f in csrc/cuda/*.cu; do \
	    nvcc -std=c++17 -O2 --use_fast_math -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
	      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr -Icsrc \
	      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	      -c $$f -o .make/cuda/$$(basename $$f .cu).o || exit 1; \
	  done && echo "cuda-check: compiled $$(ls csrc/cuda/*.cu | wc -l) CUDA sources for sm_80 and sm_90"; \
	  touch .make/cuda/stub/c10/cuda/impl/cuda_cmake_macros.h; \
	  inc=$$($(PYTHON) -c "from torch.utils.cpp_extension import include_paths as p; print(' '.join('-I' + d for d in p()))"); \
	  for f in csrc/cuda/*.cpp; do \
	    $(CXX) -std=c++17 -fsyntax-only -w -DSLIPWAY_WITH_CUDA=1 $$inc -I$${CUDA_HOME:-/usr/local/cuda}/include \
	      -idirafter .make/cuda/stub -Icsrc $$f || exit 1; \
	  done && echo "cuda-check: type-checked $$(ls csrc/cuda/*.cpp | wc -l) torch binding(s) against CUDA headers"; \
	else echo "cuda-check: nvcc or CUDA sources absent, skipped"; fi

# The CPU image the container tests run in (container=charliecloud): Debian's Python, the CPU torch and
# Slipway's kernels built inside it (containers/dev_image.py). Cached in .make/images by its inputs: only
# the first run after a change of them builds (a few minutes; csrc/ changes rebuild the kernel layer only).
dev-image: install
	TORCH_SPEC="$(TORCH_SPEC)" $(PYTHON) containers/dev_image.py build

devcluster-up:
	$(DEVCLUSTER) up

devcluster-down:
	-$(DEVCLUSTER) down

devcluster-status:
	$(DEVCLUSTER) status

# Brings the devcluster up around the suite and always down after it, keeping pytest's exit status.
# A cluster that fails to come up fails the target at once (its error and log tail are on stderr).
test: install mcore lint cuda-check dev-image
	@set -o pipefail; $(DEVCLUSTER) up | tail -n 5 || { $(DEVCLUSTER) down >/dev/null 2>&1; \
	  echo "make test: slurm/devcluster up failed (see above)" >&2; exit 1; }; \
	eval "$$($(DEVCLUSTER) env)"; \
	$(PYTHON) -m pytest $(PYTEST_ARGS); rc=$$?; \
	$(DEVCLUSTER) down >/dev/null 2>&1; exit $$rc

# The timing-sensitive tests (tests/stress.py's list) STRESS_REPS times under two CPU hogs, the devcluster up
# for the Slurm ones, STRESS_STREAMS pytest runs at a time (more load); the report goes to
# bench/results/stress.txt. Not part of `make test` (~1 h).
STRESS_REPS ?= 20
STRESS_STREAMS ?= 2
test-stress: install
	@set -o pipefail; $(DEVCLUSTER) up | tail -n 5 || { $(DEVCLUSTER) down >/dev/null 2>&1; exit 1; }; \
	eval "$$($(DEVCLUSTER) env)"; \
	$(PYTHON) -m tests.stress --reps $(STRESS_REPS) --streams $(STRESS_STREAMS) --hogs 2 \
	  --out bench/results/stress.txt; rc=$$?; \
	$(DEVCLUSTER) down >/dev/null 2>&1; exit $$rc

test-fast: install mcore
	$(PYTHON) -m pytest -m "not slurm and not slow" $(PYTEST_ARGS)

lint:
	$(PYTHON) -m ruff check .

bench: install
	$(PYTHON) bench/run_all.py

clean:
	rm -rf .make build trainer/_C*.so *.egg-info
