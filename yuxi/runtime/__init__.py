"""Session runtime: chat models, agent graph and execution."""
