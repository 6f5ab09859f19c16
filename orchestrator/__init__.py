"""Slipway orchestrator: Hydra config schema, pure planning, job-script assembly, and the submit layer."""
