"""Slipway orchestrator: what runs on the login node (Hydra, planning, job scripts, Slurm).

Pure (config → plan → scripts, golden-tested):
- ``schema`` — the Hydra root: the trainer's sections (``trainer/config``, their one definition) plus
  ``cluster``, ``container``, ``convert`` and the launch switches.
- ``checks`` (every configuration check, one module per subject, each tagged pure/inputs/world; all
  problems reported at once), ``problems`` (the problem record and the refusal), ``layout``
  (world = tp·pp·dp), ``estimate`` (memory, ETA), ``plan`` (the stage graph), ``jobs`` (picklable job
  specs, markers), ``render`` (sbatch and container text), ``container`` (the folders a containerised
  job binds, image references), ``redaction`` (what a secret looks like).
- ``docs`` — ``python -m orchestrator.docs`` writes docs/config.md; never imported at run time.

Side effects (each named in ``submit``'s docstring): ``flow`` (the launch behind launch.py),
the ``inputs`` and ``world`` checks (read inputs, the cache and the queue before submitting),
``writer_lock`` (one writer per run and checkpoint directory),
``submit`` (submitit executors, afterok chains), ``runs`` (run directories), ``queue`` (the one place
that asks squeue/sacct or the OS whether a job lives, and the job-state vocabulary), ``stages`` (what
the jobs run on the nodes), ``status``/``summary``/``follow`` (reading a run back).
"""
