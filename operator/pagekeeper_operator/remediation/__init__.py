"""Acting on memory alerts: Alertmanager webhook -> pure decisions -> evictions, Events, status.

Layers, each importing only those below it: `handlers` (kopf wiring) -> `oom` (the response
to out-of-memory crashes) -> `actions` (Kubernetes I/O) and `webhook` (HTTP) -> `remediator`
(the loop) -> `port` (what it needs of Kubernetes) and `state` (what was done) -> `decide` (pure)
-> `payload` (Alertmanager's models).
"""
