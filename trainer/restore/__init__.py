"""trainer.restore: a checkpoint back into a training run, at any layout.

- :mod:`~trainer.restore.state` — what a shard holds for the loop (model, optimizer, schedule, scaler,
  RNG, data position) and the resume paths: same layout, resharded, model-only.
- :mod:`~trainer.restore.reshard` — reading a checkpoint saved at one (tp, pp, vpp) into another.
- :mod:`~trainer.restore.distrib_optim` — the distributed optimizer's ``distrib_optim.pt``, by name.
- :mod:`~trainer.restore.dist` — the ``torch_dist`` format: what a rank writes, and reading it back.

It sits above both ``trainer.checkpoint`` (the file layout and the atomic save protocol, which knows no
parameter names) and ``trainer.convert`` (the Megatron name rules), so neither needs the other's way back.
"""
