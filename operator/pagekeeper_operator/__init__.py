"""pagekeeper's operator: reconciles LLMServer objects into GPU pods running the engine."""
