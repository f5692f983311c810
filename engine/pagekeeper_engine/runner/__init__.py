"""The model runner: owns the model and the KV-cache pool, turns a step into sampled tokens."""
