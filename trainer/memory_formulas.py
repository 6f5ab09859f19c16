"""Torch-free memory formulas the trainer's measurements and the plan share (one definition each): what a
transformer layer keeps for backward (Korthikanti et al. 2022, with the coefficients measured for Slipway's
kernels), the bytes per parameter of the weights, gradients and optimizer state, and what the interleaved
schedule adds. trainer/formulas.py holds the FLOPs, parameter and batch rules; trainer/time_formulas.py the
step time's."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ActivationProfile:
    """What one transformer layer keeps for backward, per micro-batch, in bytes:
    ``s·b·h·linear + a·s²·b·attention`` without recomputation, ``s·b·h·selective`` with selective
    recomputation (the attention scores, softmax and dropout are recomputed; SDPA's math backend also
    drops what it saves beyond q, k, v). ``replicated``: the part of ``linear`` that tensor parallelism
    without sequence parallelism does not split (the LayerNorm/dropout regions). ``source`` says where the
    numbers come from."""

    linear: float
    attention: float
    selective: float
    replicated: float
    source: str
    element: int = 2
    """Bytes per activation element: what full recomputation keeps per element of the layer's input."""
    sp_gathered: float = 4
    """Under sequence parallelism, bytes per s·b·h kept at the full sequence length: Slipway saves the
    all-gathered inputs of the QKV and first MLP matmuls (2 × 2 bytes) for their weight gradients, where
    Megatron all-gathers them again in backward. Unsplit, so ``sp_gathered·(1 − 1/t)`` more than 1/t."""
    glu: float = 3
    """A SwiGLU MLP keeps this many elements per s·b·f (f = ffn_hidden_size) where a GeLU MLP keeps 2:
    [gate; up] and SiLU(gate)·up (3, the fused kernel); eager SiLU keeps its input again (4)."""
    rmsnorm: float = 0
    """Elements per s·b·h an RMSNorm keeps beyond a LayerNorm's (the fused kernels: none; eager: its
    fp32 intermediates, 2)."""

    def for_architecture(self, m) -> ActivationProfile:
        """This profile (measured on GPT-2 layers: GeLU, f = 4h, LayerNorm, learned positions) for a model
        section ``m``: the MLP width (2 elements per s·b·f), SwiGLU (``glu``), rope (2 elements per s·b·h
        with multi-head attention) and RMSNorm (``rmsnorm``, in the replicated region). Bias-free linears
        change nothing measurable. tests/model/test_activation_memory.py measures each option alone and
        the Llama combination."""
        e, f = self.element, m.ffn_hidden_size / m.hidden_size
        mlp = ((self.glu if m.activation == "swiglu" else 2) * f - 2 * 4) * e
        # Measured: rope keeps the rotated q and k (2 elements) beside the QKV output under multi-head
        # attention; with grouped-query attention the expansion of K/V to the heads keeps the copies
        # instead, and rope adds nothing beyond its cos/sin tables.
        mha = m.query_groups == m.num_attention_heads
        rope = 2 * e if m.position_embedding == "rope" and mha else 0
        norm = self.rmsnorm * e if m.normalization == "rmsnorm" else 0
        if mlp == rope == norm == 0:
            return self
        extra = mlp + rope + norm
        return replace(self, linear=self.linear + extra, selective=self.selective + extra,
                       replicated=self.replicated + norm, source=f"{self.source}; for the architecture")


PAPER = ActivationProfile(34, 5, 34, 10, "Korthikanti et al. 2022, table 2 (Megatron's GPU kernels)",
                          sp_gathered=0)
"""The published figures, which assume Megatron's fused GPU kernels (1-byte dropout masks)."""

# Measured on CPU with bench/recompute.py (saved_tensors_hooks, tp=1; tp=2 with and without sequence
# parallelism for ``replicated``) and re-checked within 10 % by tests/model/test_activation_memory.py; in
# bytes, so the fp32 rows are about twice the 16-bit ones. They differ from the paper because CPU dropout
# keeps its mask in the activation dtype (not 1 byte), the csrc GeLU and bias-dropout-add kernels save
# less than Megatron's unfused ones, and SDPA's CPU math backend saves its own scores and output. On
# CUDA, SDPA's flash/efficient kernels keep only q, k, v, the output and the log-sum-exp, so the
# attention term vanishes without any recomputation (the paper's figures otherwise; unmeasured here).
_MEASURED = "measured, bench/results/recompute.json"
ACTIVATION_PROFILES: dict[tuple[str, str, str, int], ActivationProfile] = {
    ("cpu", "csrc", "softmax", 16): ActivationProfile(32, 6, 32, 8, _MEASURED),
    ("cpu", "csrc", "sdpa", 16): ActivationProfile(38, 12, 32, 8, _MEASURED),
    ("cpu", "eager", "softmax", 16): ActivationProfile(40, 8, 40, 10, _MEASURED, glu=4, rmsnorm=2),
    ("cpu", "eager", "sdpa", 16): ActivationProfile(46, 12, 40, 10, _MEASURED, glu=4, rmsnorm=2),
    ("cpu", "csrc", "softmax", 32): ActivationProfile(64, 12, 64, 16, _MEASURED, 4, 8),
    ("cpu", "csrc", "sdpa", 32): ActivationProfile(72, 12, 64, 16, _MEASURED, 4, 8),
    ("cpu", "eager", "softmax", 32): ActivationProfile(72, 12, 72, 20, _MEASURED, 4, 8, glu=4, rmsnorm=2),
    ("cpu", "eager", "sdpa", 32): ActivationProfile(80, 12, 72, 20, _MEASURED, 4, 8, glu=4, rmsnorm=2),
    ("cuda", "fused", "softmax", 16): PAPER,
    ("cuda", "fused", "sdpa", 16): ActivationProfile(34, 0, 34, 10, "the paper without the attention term "
                                                     "(flash/efficient SDPA on CUDA; unmeasured)",
                                                     sp_gathered=0),
    ("cuda", "fused", "softmax", 32): ActivationProfile(68, 10, 68, 20, "the paper at 4-byte activations",
                                                        4, 0),
    ("cuda", "fused", "sdpa", 32): ActivationProfile(68, 0, 68, 20, "the paper at 4-byte activations, "
                                                     "without the attention term (unmeasured)", 4, 0),
}


def activation_profile(device: str, kernels: str, attention_backend: str,
                       precision: str = "bf16") -> ActivationProfile:
    """The profile for a run: ``device`` cpu|cuda, the ``kernels`` key, ``model.attention_backend`` and
    ``train.precision``. On CPU ``auto`` means csrc (what `make install` builds) and ``compile`` is
    counted as eager (not measured: torch.compile may save less); on CUDA every kernel set uses the
    paper's figures (Megatron's kernels are the ones it measured)."""
    width = 32 if precision == "fp32" else 16
    if device == "cuda":
        return ACTIVATION_PROFILES[("cuda", "fused", attention_backend, width)]
    family = "eager" if kernels in ("eager", "compile") else "csrc"
    return ACTIVATION_PROFILES[("cpu", family, attention_backend, width)]


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               profile: ActivationProfile = PAPER) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (Korthikanti et al. 2022,
    table 2, with ``profile``'s coefficients; the paper's, for 16-bit activations, are
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism t, ``s·b·h·(34 + 5·a·s/h)/t`` with
    sequence parallelism too); selective recomputation keeps ``s·b·h·selective`` (split alike); full
    keeps only the layer's input, ``2·s·b·h`` in 16 bits (``/t`` with sequence parallelism)."""
    sbh = seq * micro_batch * hidden
    if recompute == "full":
        return profile.element * sbh / (tp if sequence_parallel else 1)
    linear = profile.selective if recompute == "selective" else profile.linear
    attention = 0.0 if recompute == "selective" else profile.attention * heads * seq / hidden
    if sequence_parallel:
        return sbh * ((linear + attention) / tp + profile.sp_gathered * (1 - 1 / tp))
    return sbh * (profile.replicated + (linear - profile.replicated) / tp + attention / tp)


def stage_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, granularity: str = "none",
                           method: str = "uniform", recompute_layers: int = 1,
                           profile: ActivationProfile = PAPER) -> float:
    """One pipeline stage's ``layers`` for one micro-batch, by Megatron's recompute methods: full
    ``uniform`` keeps the input of each group of ``recompute_layers`` layers, ``block`` recomputes the
    first ``recompute_layers`` layers and stores the rest in full. (The layers being recomputed during
    backward need one layer group's full activations transiently; not counted, as in the paper.)"""
    def per(kind: str) -> float:
        return activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp, sequence_parallel, kind,
                                          profile)

    if granularity != "full":
        return layers * per(granularity)
    k = max(1, min(recompute_layers, layers))
    if method == "uniform":
        return -(-layers // k) * per("full")
    return k * per("full") + (layers - k) * per("none")


def state_bytes_per_param(precision: str, distributed: bool = False,
                          dp: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter on one device, as Slipway keeps them.

    Without ``optim.distributed`` every precision keeps fp32 parameters (they are the master weights;
    bf16/fp16 run under autocast, trainer.optim.precision), fp32 gradients and two fp32 Adam moments:
    4 + 4 + 8 = 16. With ``optim.distributed`` (ZeRO-1, Megatron's ``--use-distributed-optimizer``) the
    optimizer state is sharded over the ``dp`` data-parallel ranks, as in Megatron's table
    (docs/source/api-guide/dist_optimizer.md): fp32 keeps 4 + 4 + 8/d; bf16/fp16 keep 16-bit parameters,
    fp32 gradient buffers and an fp32 master copy beside the moments, 2 + 4 + 12/d (18 → 6 + 12/d)."""
    if not distributed:
        return 4.0, 4.0, 8.0
    d = max(int(dp), 1)
    if precision == "fp32":
        return 4.0, 4.0, 8.0 / d
    return 2.0, 4.0, 12.0 / d


def interleaved_memory_factor(pp: int, virtual_pp: int = 1) -> float:
    """How much more activation memory the first stage holds with the interleaved schedule than with
    1F1B: ``1 + (p − 1)/(p·v)`` (Megatron's ``report_theoretical_memory``); 1 without interleaving."""
    if virtual_pp <= 1 or pp <= 1:
        return 1.0
    return 1 + (pp - 1) / (pp * virtual_pp)
