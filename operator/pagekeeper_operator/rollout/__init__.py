"""How a server's pods change (pure, but for the canary's one Prometheus query): the canary of a
pod-template change (`canary`, watched through `canary_data`), the replicas an autoscaler owns
(`autoscaling`) and which pod is replaced for its age (`pod_age`)."""
