"""trainer.run: one training run — ``run(cfg)`` and ``python -m trainer.run --config resolved.yaml``.

- :mod:`~trainer.run.entry` — ``run(cfg)``, its hooks and result, building the model and optimizer on the
  checked kernels, choosing and loading the checkpoint to resume from, and the standalone CLI.
- :mod:`~trainer.run.loop` — the training loop: steps, evaluation, log lines, saves, the graceful stop.
- :mod:`~trainer.run.data` — dataset prefixes → this rank's train and validation micro-batches.
- :mod:`~trainer.run.kernels` — the start-up kernel self-check and what it means for the optimizer.
- :mod:`~trainer.run.metrics` — Megatron-format log lines, throughput and MFU, Weights & Biases.

The loop's position (``TrainState``) is ``trainer.restore.state``'s: restoring builds it and this
package imports ``trainer.restore``, never the other way round.
"""

from trainer.run.entry import RunHooks, RunResult, run

__all__ = ["RunHooks", "RunResult", "run"]
