"""Slipway trainer: everything that runs on the nodes (data, model, parallelism, kernels, training loop).

Never imports hydra, omegaconf, submitit or orchestrator: it runs standalone from small dataclasses.
"""

__version__ = "0.1.0"
