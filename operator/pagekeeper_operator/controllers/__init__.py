"""The operator's controllers, the only code that acts: kopf's handlers for LLMServers
(`handlers`) and for remediation (`remediation_handlers`: the webhook, OOM terminations, the pod
age loop), one reconcile (`reconcile`), the periodic resync (`resync`), status refreshed between
reconciles (`refresh`), the scale-down's deletion costs (`scaledown`) and the pod-age loop
(`pod_age_loop`)."""
