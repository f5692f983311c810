"""The OpenAI-compatible HTTP server: routes, request validation, metrics and drain."""
