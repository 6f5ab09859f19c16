"""bench/step_profile.py, the tool issue 39's GPU runs read first: its kernel classes on kernel names an H100/
H200 profile shows, its window and idle arithmetic on a synthetic CUDA timeline (overlapping kernels, a gap,
a host start before the first kernel), and the CPU rehearsal end to end (the JSON it commits)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench import step_profile as sp
from tests.orchestrator.conftest import REPO

KERNELS = [  # names as torch.profiler reports them on sm_90 (cuBLAS/cutlass, flash-attn 2, cuDNN, NCCL, ...)
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
    ("aten::addmm", "GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>", "optimizer"),
    ("void at::native::(anonymous namespace)::lerp_kernel", "optimizer"),
    ("slipway::fused_layer_norm_fwd", "Slipway ops"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps<float>>>", "reductions"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>",
     "element-wise/copy/fill"),
    ("Memcpy HtoD (Pinned -> Device)", "element-wise/copy/fill"),
    ("Memset (Device)", "element-wise/copy/fill"),
    ("triton_poi_fused_add_0", "element-wise/copy/fill"),
    ("triton_red_fused_native_layer_norm_1", "reductions"),
    ("some_kernel_nobody_knows", "other"),
]


@pytest.mark.parametrize("name,cls", KERNELS)
def test_each_kernel_lands_in_its_class(name, cls):
    assert sp.classify(name) == cls


def _event(name: str, start: float, end: float, device: bool) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=kind)


def test_the_window_runs_from_the_first_step_to_the_last_kernel_and_idle_is_what_no_kernel_covers():
    """Two steps, µs: the step mark starts at 0 on the host; a GEMM 10-30, attention 30-40, a copy 35-45
    overlapping it, a gap, an AdamW 60-100. Busy is the union (10-45, 60-100: 75), the window 0-100."""
    events = [_event(sp.MARK, 0, 50, False), _event(sp.MARK, 50, 95, False),
              _event("ampere_bf16_s16816gemm_bf16_128x128", 10, 30, True),
              _event("flash_fwd_kernel", 30, 40, True), _event("Memcpy DtoD", 35, 45, True),
              _event("multi_tensor_apply_kernel", 60, 100, True),
              _event("aten::mm", 5, 6, False)]  # host ops are not device time
    s = sp.summarize(events, torch.device("cuda"), steps=2, wall_s=1.0)
    assert s["window_ms_per_step"] == pytest.approx(100 / 1e3 / 2)
    assert s["busy_ms_per_step"] == pytest.approx(75 / 1e3 / 2)
    assert s["idle_share"] == pytest.approx(0.25)
    assert {c: r["ms_per_step"] for c, r in s["classes"].items()} == pytest.approx(
        {"optimizer": 0.02, "attention": 0.005, "GEMM": 0.01, "element-wise/copy/fill": 0.005})
    # in CLASSES' order
    assert list(s["classes"]) == ["optimizer", "attention", "GEMM", "element-wise/copy/fill"]
    assert s["classes"]["optimizer"]["share"] == pytest.approx(0.4)
    assert s["classes"]["GEMM"]["count_per_step"] == pytest.approx(0.5)


def test_the_cpu_rehearsal_profiles_real_steps_and_writes_its_json(tmp_path):
    out = subprocess.run([sys.executable, "bench/step_profile.py", "--device", "cpu", "--model", "gpt_tiny",
                          "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                          "--tag", "t"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not in any op (Python, loop, waits)" in out.stdout and "GEMM" in out.stdout, out.stdout
    d = json.loads((tmp_path / "profile_cpu_t.json").read_text())
    assert d["steps"] == 2 and d["spec"]["model"] == "gpt_tiny" and d["commit"]
    classes = d["classes"]
    assert set(classes) <= {c for c, _ in sp.CLASSES} and {"GEMM", "Slipway ops"} <= set(classes), classes
    assert sum(r["ms_per_step"] for r in classes.values()) == pytest.approx(d["busy_ms_per_step"])
    assert 0 <= d["idle_share"] < 1 and d["busy_ms_per_step"] <= d["window_ms_per_step"]
    assert d["rates"]["tokens_s"] > 0 and d["rates"]["loss"] > 0
