"""A run's launches: its record (run.json) and the one-writer lock."""
