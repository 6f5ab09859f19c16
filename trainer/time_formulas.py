"""Torch-free step-time formulas the plan's estimate uses (one definition each): how a device's efficiency
grows with the size of its matrix products (the micro-batch), the pipeline bubble, recomputation's extra
forward, the collectives at a bus bandwidth (tensor-parallel all-reduces, pipeline transfers).
trainer/formulas.py holds the FLOPs they divide; trainer/memory_formulas.py the memory's."""

from __future__ import annotations

import math
from collections.abc import Sequence


def gemm_size(micro_batch: int, seq: int, hidden: int, tp: int = 1) -> float:
    """How large a transformer layer's matrix products are for one micro-batch on one device, as
    ``tokens · h² / tp``: each of them multiplies the micro-batch's b·s tokens by an h × (k·h) weight that
    tensor parallelism splits t ways, so its work is a fixed multiple of this. What the micro-batch
    efficiency (:func:`saturation`) depends on: a micro-batch of another model or tp is as large as one
    of this size, whatever its tokens."""
    return micro_batch * seq * hidden**2 / max(tp, 1)


def saturation(size: float, half: float) -> float:
    """The share of its saturated speed a device reaches on matrix products of ``size`` (:func:`gemm_size`):
    ``size / (size + half)``, with ``half`` the size at which it reaches half of it; 1 at an infinite size
    (a figure that means "saturated"). The form of a fixed cost per kernel (its launch, a wave's tail) beside
    work that grows with the size: a time ``c + size/r`` runs at ``size/(size + c·r)`` of the rate ``r``."""
    return 1.0 if math.isinf(size) else size / (size + half)


def fit_saturation(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(top, half)`` of ``y = top · saturation(x, half)`` by least squares over ``points`` (x, y), each
    x > 0: for a given half the best top is linear, Σy·g / Σg² (g = saturation(x, half)), so only half is
    searched, on a logarithmic grid across a thousandth to a thousand times the sizes measured, then by
    golden section around the grid's best. ValueError with fewer than two distinct sizes."""
    xs = sorted({x for x, _ in points})
    if len(xs) < 2 or xs[0] <= 0:
        raise ValueError(f"a saturation curve needs two or more positive sizes, not {sorted(xs)}")

    def top_and_error(log_half: float) -> tuple[float, float]:
        g = [(saturation(x, math.exp(log_half)), y) for x, y in points]
        top = sum(gi * y for gi, y in g) / sum(gi * gi for gi, _ in g)
        return top, sum((y - top * gi) ** 2 for gi, y in g)

    lo, hi, n = math.log(xs[0] / 1e3), math.log(xs[-1] * 1e3), 240
    grid = [lo + (hi - lo) * i / n for i in range(n + 1)]
    best = min(range(n + 1), key=lambda i: top_and_error(grid[i])[1])
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, n)]
    ratio = (math.sqrt(5) - 1) / 2
    while b - a > 1e-12:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if top_and_error(c)[1] <= top_and_error(d)[1]:
            b = d
        else:
            a = c
    return top_and_error((a + b) / 2)[0], math.exp((a + b) / 2)


def bubble_fraction(pp: int, num_microbatches: int, virtual_pp: int = 1) -> float:
    """Idle fraction of a pipelined step, ``(p − 1)/(v·m)`` of the ideal time (Narayanan et al. 2021,
    §2.2.1–2.2.2): the step takes ``(1 + (p − 1)/(v·m))`` times the work of one stage's micro-batches."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (max(virtual_pp, 1) * max(num_microbatches, 1))


def recompute_time_factor(granularity: str, seq: int, hidden: int, layers: int = 1, method: str = "uniform",
                          recompute_layers: int = 1) -> float:
    """How much longer a step takes with recomputation, by FLOPs (a compute-bound GPU): a recomputed
    layer runs its forward twice, and the forward is 1/3 of forward + backward (Megatron counts full
    recomputation as 4/3 of the model FLOPs). Selective recomputes only the core attention, ``4·b·s²·h``
    of the layer's ``24·b·s·h² + 4·b·s²·h`` forward FLOPs. On CPU, where the recomputed softmax and
    dropout are memory-bound, bench/recompute.py measures more (1.4–1.8× per layer)."""
    if granularity == "selective":
        return 1 + seq / (6 * hidden + seq) / 3
    if granularity == "full":
        share = 1.0 if method == "uniform" else min(recompute_layers, layers) / max(layers, 1)
        return 1 + share / 3
    return 1.0


# The bytes each rank moves per byte of the buffer, as nccl-tests defines bus bandwidth (its
# doc/PERFORMANCE.md): a ring all-reduce sends 2(n − 1)/n, a reduce-scatter or all-gather (n − 1)/n.
COLLECTIVE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                     "all_gather": lambda n: (n - 1) / n}


def collective_seconds(kind: str, nbytes: float, ranks: int, bus_gbps: float) -> float:
    """Time of one collective over ``ranks`` ranks on a ``nbytes`` buffer at a bus bandwidth of ``bus_gbps``
    GB/s (what nccl-tests prints as busbw): ``nbytes · factor(n) / busbw``; 0 for one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * COLLECTIVE_FACTOR[kind](ranks) / (bus_gbps * 1e9)


def tensor_parallel_seconds(layers: float, micro_batch: int, seq: int, hidden: int, tp: int,
                            element_bytes: int, bus_gbps: float, recomputed_layers: float = 0) -> float:
    """The tensor-parallel communication of one micro-batch through ``layers`` transformer layers, which
    nothing overlaps (each all-reduce sits between two matrix products): Megatron's split needs "only two
    all-reduce operations in the forward pass and two in the backward pass" per layer (Shoeybi et al. 2019,
    §3 and fig. 4), each over the ``b·s·h`` activations in the compute dtype (``element_bytes``), a ring
    all-reduce costing ``2(t − 1)/t · bytes / busbw`` (:func:`collective_seconds`) — Narayanan et al. 2021,
    §3.3.1: ``8·b·s·h·(t − 1)/t`` per layer, device and micro-batch. Sequence parallelism swaps each
    all-reduce for an all-gather plus a reduce-scatter of the same bytes (Korthikanti et al. 2022, §4.2.2):
    the same time. A layer recomputed in full runs its forward, and its two all-reduces, again
    (``recomputed_layers``); selective recomputation recomputes no communication."""
    one = collective_seconds("all_reduce", micro_batch * seq * hidden * element_bytes, tp, bus_gbps)
    return (4 * layers + 2 * recomputed_layers) * one


def pipeline_p2p_seconds(num_microbatches: int, micro_batch: int, seq: int, hidden: int,
                         element_bytes: int, gbps: float) -> float:
    """The pipeline's point-to-point traffic of one step on the slowest link between two stages: each
    micro-batch's activations forward and their gradient back, ``b·s·h`` elements each way (Narayanan et al.
    2021, §3.3.1: "the total amount of communication ... between every pair of consecutive devices (for
    either the forward or backward pass) for each microbatch is bsh"), waited for in 1F1B's steady state."""
    return 2 * num_microbatches * micro_batch * seq * hidden * element_bytes / (gbps * 1e9)
