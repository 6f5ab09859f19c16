"""What every layer above shares: the schema, site and hardware, layout and estimates, problems, the
plan types."""
