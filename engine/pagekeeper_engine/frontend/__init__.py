"""The front end: the OpenAI-compatible HTTP server, tokenization, incremental detokenization,
stop strings and SSE, talking to the engine core through `messages` only."""
