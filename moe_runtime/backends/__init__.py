"""Built-in backends (imported only when the planner selects them)."""
