"""The launch behind launch.py: record, check, submit (and cancel); sweeps."""
