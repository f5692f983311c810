"""The memory alerts shipped with each LLMServer (pure): which triggers are active
(`triggers`), one rule's shape (`rule`), the host-memory alerts (`host`) and the rendered
PrometheusRule and rules file (`render`)."""
