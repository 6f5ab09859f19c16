"""Slipway orchestrator: what runs on the login node (Hydra, planning, job scripts, Slurm). Folders are
layers; each imports only those before it (tests/test_imports.py checks the folder graph has no cycle):

1. ``base`` — the vocabulary: ``schema`` (the Hydra root over trainer/config's sections), ``site`` and
   ``hardware``, ``layout`` (world = tp·pp·dp), ``estimate`` (memory, ETA), ``problems`` (the record and
   the refusal), ``redaction``, ``overrides``, ``facts`` and ``plan_types`` (Plan, StagePlan, JobResources,
   Context).
2. ``world`` — what exists outside the process: ``queue`` (the one place that asks squeue/sacct or the OS
   whether a job lives; the job-state vocabulary), ``sinfo``, ``accounting`` (sacctmgr), ``runs`` (run
   and cache folders), ``content_hash``, ``progress``, ``local_jobs``, ``container`` (the folders a
   containerised job binds).
3. render: ``render`` and ``container_render`` (sbatch and container text, pure, golden-tested) stay at the
   root: every job script names orchestrator/render.py.
4. ``stages`` — one module per stage: its plan, resources, and what its job runs on the nodes.
5. ``record`` — a run's launches: ``launches`` (run.json) and ``writer_lock`` (one writer per run).
6. ``checks`` — every configuration check, one module per subject, tagged pure/inputs/world.
7. ``planning`` — config → Plan (pure): ``plan`` (the stage graph), ``autolayout``, ``plan_format``,
   ``data_shares``.
8. ``readback`` — reading a run back: ``status``, ``summary``, ``logs``, ``follow``, ``listing``,
   ``culprit`` (which rank of a failed training job failed first, and why).
9. ``launch`` — the side effects behind launch.py: ``flow`` (record, check, submit), ``submit`` (submitit
   executors, afterok chains), ``sweep``, ``cancel``.

At the root: ``__main__`` (``python -m orchestrator``), ``docs`` (``python -m orchestrator.docs`` writes
docs/config.md; never imported at run time), and ``jobs`` (the names old job pickles use).
"""
