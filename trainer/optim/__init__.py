"""The optimizer step and what shapes it, with Megatron's semantics.

- :mod:`~trainer.optim.optimizer` — AdamW with Megatron's parameter groups (no decay on biases and 1-D
  parameters) and the choice of implementation (apex FusedAdam, torch fused, Slipway's csrc kernel).
- :mod:`~trainer.optim.lr` — Megatron's ``OptimizerParamScheduler`` (warm-up, then cosine/linear/constant
  decay, counted in samples).
- :mod:`~trainer.optim.precision` — autocast contexts and Megatron's dynamic loss scaler (fp16).
"""
