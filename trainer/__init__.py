"""Slipway trainer: everything that runs on the nodes.

Packages, one concern each: ``config`` (the configuration sections; torch-free, the Hydra schema is built
from them), ``data``, ``model`` (single-device GPT), ``parallel`` (state, comm, TP layers, the one
sharding table, pipeline schedules, data-parallel buckets), ``ops`` (kernels), ``optim`` (optimizer, LR,
precision), ``checkpoint`` (files and tracker, save protocol, verification, disk space), ``health``
(heartbeats, watchdog, preflight), ``convert`` (Hugging Face and Megatron conversion), ``restore`` (a
checkpoint back into a run at any layout: above both checkpoint and convert), ``eval`` (HumanEval and
perplexity of the converted model), and ``run``: the training run itself (``run(cfg)`` and
``python -m trainer.run``, the loop, its data and kernel set-up, metrics and W&B).

Facts several packages share, and the orchestrator too, live torch-free in ``config`` and in the
top-level modules: ``config_issues``, ``formulas`` (FLOPs, vocab padding, batch rules, the pipeline split),
``memory_formulas`` (activations, state bytes per parameter), ``time_formulas`` (the step time's terms),
``signals`` (exit codes), ``metrics_file``, ``goodput`` (where a run's time went), ``run_files`` (every
file of a run), ``devices`` (the GPU table), ``wandb_key``, ``wandb_online``, ``disk``, ``faults`` (the
fault tests' seam) and ``log`` (the logger);
:data:`CONTRACT` lists every module the orchestrator may import. ``cli`` generates a command line's
flags from a config dataclass; ``extension`` loads the csrc kernels.

Never imports hydra, omegaconf, submitit or orchestrator (tests/test_imports.py): it runs standalone
from small dataclasses.
"""

__version__ = "0.1.0"

# The trainer's modules the orchestrator (the login node) may import, all torch-free: the run's files and
# names, the formulas and rules both sides compute, exit codes, the config sections and job specs the plan
# builds, and the readers of what a run writes. Anything else of the trainer the orchestrator reaches only
# inside a stage's node callable or an input check (tests/test_imports.py).
CONTRACT = (
    "trainer.run_files", "trainer.formulas", "trainer.memory_formulas", "trainer.time_formulas",
    "trainer.signals", "trainer.config_issues", "trainer.log",
    "trainer.faults", "trainer.disk", "trainer.field_docs",
    "trainer.config", "trainer.data.corpus_config", "trainer.data.preprocess", "trainer.convert.run_config",
    "trainer.eval.config", "trainer.data.tokenizer_identity",
    "trainer.data.blend", "trainer.data.splits", "trainer.data.hf_tokenizer",
    "trainer.metrics_file", "trainer.checkpoint.files", "trainer.checkpoint.verify", "trainer.health",
    "trainer.eval.results", "trainer.wandb_key", "trainer.wandb_online", "trainer.devices",
    "trainer.measured", "trainer.kernel_build", "trainer.goodput", "trainer.goodput.account",
    "trainer.goodput.clock",
)
