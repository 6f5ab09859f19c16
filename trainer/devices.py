"""The GPUs Slipway knows, torch-free: memory and dense peak throughput, each figure from the vendor's
datasheet (named beside each entry). One table for both sides: the plan reads it for a site file's
``cluster.device_name`` (orchestrator/base/estimate.py), the trainer for the GPU it runs on (its MFU,
trainer/run/metrics.py).

Each entry also holds the datasheet's GPU-to-GPU bandwidth within a node (NVLink per GPU, both directions
together; PCIe where the card has no NVLink): the plan's tensor-parallel all-reduces run at half of it
(:attr:`Gpu.intra_node_bus_gbps`).

Peaks are *dense* (NVIDIA's datasheets print the 16-bit and 8-bit tensor-core figures "with sparsity",
twice the dense rate: the figures below are half of those) and per GPU. ``fp32`` is the non-tensor FP32
rate: the trainer leaves TF32 off, so an fp32 run's matrix products run there.

Names are matched after normalisation (upper case, "NVIDIA"/"Tesla" dropped, every run of other characters
one "-"), so a site file's ``H100-80GB``, ``h100 sxm`` and torch's ``NVIDIA H100 80GB HBM3`` all find the
same entry. The entries are tried in order, specific before general: GH200 before H200 (whose name it
contains), the PCIe and NVL cards before the plain H100, which is the SXM part (torch names the PCIe card
``NVIDIA H100 PCIe``, the SXM one ``NVIDIA H100 80GB HBM3``). An A100 without its memory size matches
nothing: the two sizes plan differently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Datasheets (NVIDIA, as published on nvidia.com):
A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"
H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com, nvidia-tensor-core-gpu-datasheet)"
H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (resources.nvidia.com, hpc-datasheet-sc23-h200)"
GH200_DS = "NVIDIA GH200 Grace Hopper Superchip datasheet"
B200_DS = "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx, per-GPU column)"
L40S_DS = "NVIDIA L40S GPU datasheet"


@dataclass(frozen=True)
class Gpu:
    """One GPU model: what the plan and the trainer's MFU need of it."""

    name: str  # as the plan prints it
    pattern: str  # a regular expression searched in the normalised name (see the module docstring)
    memory_gb: float  # device memory as the datasheet gives it
    tflops_16bit: float  # dense bf16 and fp16 tensor-core peak (equal on every GPU listed)
    fp32_tflops: float  # non-tensor FP32 peak
    bf16: bool
    link_gbps: float  # GPU-to-GPU bandwidth within a node, GB/s, both directions (NVLink; PCIe without it)
    source: str  # the datasheet and the figures it prints

    def peak_tflops(self, precision: str) -> float | None:
        """The dense peak for ``train.precision``; None when the GPU has no such unit (bf16 before Ampere)."""
        if precision == "fp32":
            return self.fp32_tflops
        if precision == "bf16" and not self.bf16:
            return None
        return self.tflops_16bit

    @property
    def intra_node_bus_gbps(self) -> float:
        """The bus bandwidth of a ring collective between this node's GPUs, in GB/s: half the datasheet's
        bidirectional link figure, since a ring sends each byte one way (nccl-tests doc/PERFORMANCE.md: busbw
        approaches the per-direction link bandwidth; all_reduce_perf on 8 H100 SXM reports ≈ 360-450 GB/s
        against NVLink's 900 GB/s both ways)."""
        return self.link_gbps / 2


KNOWN_GPUS: tuple[Gpu, ...] = (
    # A100: "BFLOAT16 Tensor Core 312 TFLOPS | 624 TFLOPS*", "FP16 Tensor Core 312 | 624*", "FP32 19.5
    # TFLOPS" (* with sparsity); "GPU Memory 40GB HBM2 | 80GB HBM2e" (SXM and PCIe alike); "NVIDIA NVLink
    # 600GB/s" (SXM; PCIe: between the two GPUs of an NVLink bridge, else "PCIe Gen4 64GB/s").
    Gpu("A100-80GB", r"A100.*80", 80.0, 312.0, 19.5, True, 600, f"{A100_DS}: 312 TFLOPS bf16/fp16, 80 GB"),
    Gpu("A100-40GB", r"A100.*40", 40.0, 312.0, 19.5, True, 600, f"{A100_DS}: 312 TFLOPS bf16/fp16, 40 GB"),
    # GH200: "FP16/BF16 1,979 TFLOPS*" (with sparsity), "FP32 67 TFLOPS", "96GB HBM3 | 144GB HBM3e".
    # torch names the HBM3e part by its HBM ("GH200 144G HBM3e"), the HBM3 one by its total memory
    # ("GH200 480GB": 96 GB HBM3 + 480 GB LPDDR5X on the Grace side). "NVLink 900GB/s" between superchips.
    Gpu("GH200-144GB", r"GH200.*(144|HBM3E)", 144.0, 989.0, 67.0, True, 900,
        f"{GH200_DS}: 1,979 TFLOPS bf16/fp16 with sparsity (989 dense), 144 GB HBM3e"),
    Gpu("GH200-96GB", r"GH200", 96.0, 989.0, 67.0, True, 900,
        f"{GH200_DS}: 1,979 TFLOPS bf16/fp16 with sparsity (989 dense), 96 GB HBM3"),
    # H200: SXM "BFLOAT16 Tensor Core 1,979 TFLOPS*", "FP32 67 TFLOPS"; NVL 1,671* and 60; "141GB HBM3e";
    # "NVIDIA NVLink: 900GB/s" (NVL: "2- or 4-way NVIDIA NVLink bridge: 900GB/s per GPU").
    Gpu("H200-NVL-141GB", r"H200.*NVL", 141.0, 835.0, 60.0, True, 900,
        f"{H200_DS}: H200 NVL 1,671 TFLOPS bf16/fp16 with sparsity (835 dense), 141 GB"),
    Gpu("H200-SXM-141GB", r"H200", 141.0, 989.0, 67.0, True, 900,
        f"{H200_DS}: H200 SXM 1,979 TFLOPS bf16/fp16 with sparsity (989 dense), 141 GB"),
    # H100: SXM "BFLOAT16 Tensor Core 1,979 TFLOPS*", "FP32 67", 80 GB; PCIe 1,513* and 51, 80 GB;
    # NVL 1,671* and 60, 94 GB; "NVLink: 900GB/s" (SXM), "NVLink: 600GB/s" (PCIe, an NVLink bridge between
    # two cards: a wider group goes over "PCIe Gen5: 128GB/s"; NVL).
    Gpu("H100-NVL-94GB", r"H100.*NVL", 94.0, 835.0, 60.0, True, 600,
        f"{H100_DS}: H100 NVL 1,671 TFLOPS bf16/fp16 with sparsity (835 dense), 94 GB"),
    Gpu("H100-PCIe-80GB", r"H100.*PCIE", 80.0, 756.0, 51.0, True, 600,
        f"{H100_DS}: H100 PCIe 1,513 TFLOPS bf16/fp16 with sparsity (756 dense), 80 GB"),
    Gpu("H100-SXM-80GB", r"H100", 80.0, 989.0, 67.0, True, 900,
        f"{H100_DS}: H100 SXM 1,979 TFLOPS bf16/fp16 with sparsity (989 dense), 80 GB"),
    # HGX B200, per GPU: "FP16/BF16 Tensor Core 4.5 PFLOPS" (with sparsity), "FP32 75 TFLOPS", "180GB
    # HBM3E", "NVLink 1.8TB/s". Not GB200 (a G before it): its B200 runs at other clocks (5 PFLOPS, 186 GB).
    Gpu("B200-180GB", r"(?<![A-Z0-9])B200", 180.0, 2250.0, 75.0, True, 1800,
        f"{B200_DS}: 4.5 PFLOPS bf16/fp16 with sparsity (2,250 dense), 180 GB"),
    # L40S: "BF16 Tensor Core 362.05 | 733 TFLOPS*", "FP16 Tensor Core 362.05 | 733*", "FP32 91.6",
    # "48GB GDDR6 with ECC"; no NVLink: "PCIe Gen4 x16: 64GB/s bidirectional".
    Gpu("L40S-48GB", r"L40S", 48.0, 362.05, 91.6, True, 64,
        f"{L40S_DS}: 362.05 TFLOPS bf16/fp16 dense, 48 GB"),
)


def normalise(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100-80GB-HBM3`` (see the module docstring)."""
    text = re.sub(r"\b(NVIDIA|TESLA)\b", " ", name.upper())
    return re.sub(r"[^A-Z0-9]+", "-", text).strip("-")


def find_gpu(name: str | None) -> Gpu | None:
    """The table's entry for a GPU name (a site file's or torch's), or None."""
    key = normalise(name or "")
    if not key:
        return None
    return next((g for g in KNOWN_GPUS if re.search(g.pattern, key)), None)


def known_names() -> str:
    return ", ".join(g.name for g in KNOWN_GPUS)
