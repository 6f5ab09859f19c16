"""Checkpoints in Megatron's legacy layout (``formats.md`` §4): written atomically, verified, resharded.

- :mod:`~trainer.checkpoint.layout` — folder and file names, the tracker (torch-free; ``convert/`` and the
  orchestrator read checkpoints through it).
- :mod:`~trainer.checkpoint.protocol` — the numbered save protocol (temporary folder, fsync, rename,
  barrier, tracker commit, prune) and loading.
- :mod:`~trainer.checkpoint.verify` — manifests and digests, choosing the latest checkpoint that verifies,
  quarantining damaged ones (torch-free: the plan checks sizes on the login node).
- :mod:`~trainer.checkpoint.space` — bytes a save needs and whether an error means a full disk.
- :mod:`~trainer.checkpoint.reshard` — loading a checkpoint saved at one (tp, pp) into another.

The resume state (what a shard holds for the training loop, ``trainer.ckpt_state``) stays outside this
package: it imports the loop, and ``convert/`` must never sit above the loop. This ``__init__`` imports
nothing, so the torch-free modules stay torch-free.
"""
