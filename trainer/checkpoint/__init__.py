"""Checkpoints in Megatron's layouts (``formats.md`` §4; torch_dist): written atomically and verified.

- :mod:`~trainer.checkpoint.files` — folder and file names, the tracker (torch-free; ``convert/`` and the
  orchestrator read checkpoints through it).
- :mod:`~trainer.checkpoint.protocol` — the numbered save protocol (temporary folder, fsync, rename,
  barrier, tracker commit, prune) and loading.
- :mod:`~trainer.checkpoint.verify` — manifests and digests, choosing the latest checkpoint that verifies,
  quarantining damaged ones (torch-free: the plan checks sizes on the login node).
- :mod:`~trainer.checkpoint.space` — bytes a save needs and whether an error means a full disk.
- :mod:`~trainer.checkpoint.dist_write` — writing Megatron-core's ``torch_dist`` format (chunks at their
  global offsets) through the same protocol; what a rank writes is ``trainer.restore.dist``'s.

Reading a checkpoint back into a run (the resume state, resharding, ``distrib_optim.pt``) is
``trainer.restore``'s: it needs the parameter names (``convert/``) and the loop, which this package never
imports. This ``__init__`` imports
nothing, so the torch-free modules stay torch-free.
"""
