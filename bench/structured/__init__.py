"""`loraplex bench structured`: structured outputs and tool calls in the served step."""
