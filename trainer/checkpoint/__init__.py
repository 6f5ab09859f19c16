"""Checkpoints in Megatron's layouts (``formats.md`` §4; torch_dist): written atomically, verified, resharded.

- :mod:`~trainer.checkpoint.layout` — folder and file names, the tracker (torch-free; ``convert/`` and the
  orchestrator read checkpoints through it).
- :mod:`~trainer.checkpoint.protocol` — the numbered save protocol (temporary folder, fsync, rename,
  barrier, tracker commit, prune) and loading.
- :mod:`~trainer.checkpoint.verify` — manifests and digests, choosing the latest checkpoint that verifies,
  quarantining damaged ones (torch-free: the plan checks sizes on the login node).
- :mod:`~trainer.checkpoint.space` — bytes a save needs and whether an error means a full disk.
- :mod:`~trainer.checkpoint.reshard` — loading a checkpoint saved at one (tp, pp) into another.
- :mod:`~trainer.checkpoint.dist_write` — writing Megatron-core's ``torch_dist`` format (chunks at their
  global offsets) through the same protocol; what a rank writes is ``trainer.ckpt_dist``'s.

The resume state (what a shard holds for the training loop, ``trainer.ckpt_state``) stays outside this
package: it imports the loop, and ``convert/`` must never sit above the loop. This ``__init__`` imports
nothing, so the torch-free modules stay torch-free.
"""
