"""config → Plan (pure): the stage graph, the layout search, the plan's text."""
