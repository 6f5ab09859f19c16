"""The site's hardware as the plan uses it, each value with where it came from (pure).

The site file (``hydra_conf/cluster/<site>.yaml``) is the one place for a site's hardware
(:data:`HARDWARE`); an experiment asks for a layout (:data:`LAYOUT`) and never changes it.
orchestrator/base/site.py, which knows Hydra, records where each value came from in
``cluster.hardware_sources``; this module adds what the device table (trainer/devices.py) and the measured
figures (orchestrator/base/measured.py) fill in for the values the site leaves null, so the plan can print
every figure it used and its source. An MFU figure holds at the micro-batch it was measured at (a site's
``cluster.mfu``: at saturation); the measured efficiency curve scales it to another
(:meth:`Hardware.mfu_at`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from orchestrator.base.measured import EfficiencyCurve, MeasuredMfu, efficiency_curves, measured_figures
from orchestrator.base.schema import ClusterConfig, SlipwayConfig
from trainer.devices import Gpu, find_gpu

# The site's facts: only the site file sets them (an experiment's value is not used; a command line's must
# not exceed the site's, orchestrator/checks/cluster.py).
HARDWARE = ("max_nodes", "gpus_per_node", "cpus_per_node", "mem_per_node_gb", "device_name",
            "device_memory_gb", "device_peak_tflops", "device_bf16", "bus_bandwidth_gbps",
            "intra_node_bandwidth_gbps")
# What a run asks of the site: an experiment may set these.
LAYOUT = ("gpus", "nodes", "tasks_per_node", "cpus_per_task", "mem_gb", "mfu")
# Figures for the values a CPU site leaves null: a few cores, no measurement (the plan's ETA is a rough
# guide there; the local and devcluster files set their own).
CPU_PEAK_TFLOPS = 0.05
CPU_MFU = 0.3
# gloo between the processes of one node (loopback TCP): all_reduce of 8 MB measured ≈ 0.7 GB/s busbw on
# the 2-core development machine, so about 1.
CPU_INTRA_NODE_GBPS = 1.0


@dataclass(frozen=True)
class Fact:
    value: Any  # None: unknown
    source: str


@dataclass(frozen=True)
class Hardware:
    """What the plan uses of one device: its table entry, memory, peak, bf16, the MFU for the ETA and the
    bus bandwidth between the GPUs of a node (the tensor-parallel all-reduces'), and how the MFU grows with
    the micro-batch."""

    gpu: Gpu | None
    memory_gb: Fact  # 0: unknown
    peak_tflops: Fact  # None: unknown (a GPU the table does not know, without a peak)
    bf16: Fact
    mfu: Fact
    intra_node_gbps: Fact
    efficiency: Fact = Fact(None, "none")  # an EfficiencyCurve; None: every micro-batch at the MFU
    mfu_size: float = math.inf  # the matrix products' size the MFU holds at (inf: saturated)

    def mfu_at(self, size: float) -> float:
        """The MFU on matrix products of ``size`` (trainer.time_formulas.gemm_size): the figure, scaled by the
        efficiency curve from the size it holds at to this one; the figure itself without a curve."""
        curve: EfficiencyCurve | None = self.efficiency.value
        if curve is None:
            return self.mfu.value
        return self.mfu.value * curve.efficiency(size) / curve.efficiency(self.mfu_size)


def source(c: ClusterConfig, key: str) -> str:
    """Where ``cluster.<key>`` came from, as launch.py recorded it ("config" when built without it)."""
    return c.hardware_sources.get(key, "config")


def is_cpu(c: ClusterConfig) -> bool:
    return c.device_name.strip().lower() == "cpu"


def _from_table(c: ClusterConfig, key: str, value: Any, gpu: Gpu | None, table: Any) -> Fact:
    """A site value when set, else the device table's (None when the table does not know the device)."""
    if value is not None:
        return Fact(value, source(c, key))
    overruled = source(c, key) if "not used" in source(c, key) else ""  # an experiment's value (site.py)
    if gpu is None:
        return Fact(None, f"not set ({c.device_name} is not in the device table){overruled and '; '}"
                          f"{overruled}")
    return Fact(table, f"device table: {gpu.source}" + (f" ({overruled})" if overruled else ""))


def plan_mfu(c: ClusterConfig, gpu: Gpu | None, precision: str,
             figures: tuple[MeasuredMfu, ...] | None = None) -> tuple[Fact, float]:
    """The MFU of the ETA and the size of matrix products it holds at: the configured one (at saturation),
    else the figure measured on this GPU (in this precision first; at the size it was measured at), else
    the one measured on another GPU (named), else :data:`CPU_MFU` on CPUs."""
    if c.mfu is not None:
        return Fact(c.mfu, source(c, "mfu")), math.inf
    if is_cpu(c):
        return Fact(CPU_MFU, "assumed for CPUs (none measured)"), math.inf
    figures = measured_figures() if figures is None else figures
    name = gpu.name if gpu else c.device_name
    ranked = sorted(figures, key=lambda f: (f.gpu != name, f.precision != precision))
    if not ranked:
        return (Fact(CPU_MFU, f"assumed: no MFU measured on any GPU in bench/ (set cluster.mfu for {name})"),
                math.inf)
    f = ranked[0]
    where = f"measured on {f.gpu}" if f.gpu == name else f"measured on {f.gpu}, none yet on {name}"
    return Fact(f.mfu, f"{where} ({f.what}; {f.source})"), f.size


def plan_curve(c: ClusterConfig, gpu: Gpu | None, precision: str,
               curves: tuple[EfficiencyCurve, ...] | None = None) -> Fact:
    """How the MFU grows with the micro-batch: the curve fitted on this GPU (this precision first), else on
    another GPU (named); none on CPUs (nothing measured there: every micro-batch runs at the MFU)."""
    if is_cpu(c):
        return Fact(None, "none measured on CPUs: every micro-batch at the MFU")
    curves = efficiency_curves() if curves is None else curves
    name = gpu.name if gpu else c.device_name
    ranked = sorted(curves, key=lambda f: (f.gpu != name, f.precision != precision))
    if not ranked:
        return Fact(None, "none measured in bench/: every micro-batch at the MFU")
    f = ranked[0]
    where = f"measured on {f.gpu}" if f.gpu == name else f"measured on {f.gpu}, none yet on {name}"
    return Fact(f, f"x/(x + half) of {f.top:.1%} MFU, x = tokens × hidden² / tp, least squares to "
                   f"micro-batches {where} ({f.what}; {f.source})")


def hardware(cfg: SlipwayConfig, figures: tuple[MeasuredMfu, ...] | None = None,
             curves: tuple[EfficiencyCurve, ...] | None = None) -> Hardware:
    c, precision = cfg.cluster, cfg.train.precision
    if is_cpu(c):
        mem = Fact(c.device_memory_gb or 0.0,
                   source(c, "device_memory_gb") if c.device_memory_gb else "not checked on CPUs")
        peak = Fact(c.device_peak_tflops or CPU_PEAK_TFLOPS, source(c, "device_peak_tflops")
                    if c.device_peak_tflops else "assumed for CPUs")
        bf16 = Fact(True if c.device_bf16 is None else c.device_bf16, source(c, "device_bf16"))
        link = Fact(c.intra_node_bandwidth_gbps or CPU_INTRA_NODE_GBPS,
                    source(c, "intra_node_bandwidth_gbps") if c.intra_node_bandwidth_gbps
                    else "assumed for CPUs (gloo within a node)")
        mfu, size = plan_mfu(c, None, precision, figures)
        return Hardware(None, mem, peak, bf16, mfu, link, plan_curve(c, None, precision, curves), size)
    gpu = find_gpu(c.device_name)
    memory = _from_table(c, "device_memory_gb", c.device_memory_gb, gpu, gpu and gpu.memory_gb)
    if memory.value is None:
        memory = Fact(0.0, memory.source)
    peak = _from_table(c, "device_peak_tflops", c.device_peak_tflops, gpu,
                       gpu and gpu.peak_tflops(precision))
    if peak.value is None and gpu is not None:
        peak = Fact(None, f"{gpu.name} has no {precision} unit (device table: {gpu.source})")
    bf16 = _from_table(c, "device_bf16", c.device_bf16, gpu, gpu and gpu.bf16)
    if bf16.value is None:
        bf16 = Fact(True, f"assumed ({c.device_name} is not in the device table)")
    link = _from_table(c, "intra_node_bandwidth_gbps", c.intra_node_bandwidth_gbps, gpu,
                       gpu and gpu.intra_node_bus_gbps)
    if c.intra_node_bandwidth_gbps is None and gpu is not None:
        link = Fact(link.value, f"device table: {gpu.link_gbps:g} GB/s between {gpu.name}s both ways, half "
                                "each way (a ring's)")
    elif link.value is None:  # a GPU the table does not know: no faster than the network, at least
        link = Fact(c.bus_bandwidth_gbps, f"cluster.bus_bandwidth_gbps ({link.source})")
    mfu, size = plan_mfu(c, gpu, precision, figures)
    return Hardware(gpu, memory, peak, bf16, mfu, link, plan_curve(c, gpu, precision, curves), size)
