"""The operator's edges, one per outside API: `kube` (the one Kubernetes adapter, over one API
client), with `plan` (pure: which rendered objects need a server-side apply), and `prometheus`
(the one Prometheus client)."""
