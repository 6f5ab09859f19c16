"""Reading a run back: status, summary, logs, follow, list."""
