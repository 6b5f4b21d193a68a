"""The HTTP API (Litestar): validates, authorizes and calls services; it never
executes a model."""
