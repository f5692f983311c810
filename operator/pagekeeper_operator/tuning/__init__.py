"""The memory policy tunes itself: metric windows in, recommendations out, canary trials decided.

Pure modules (`window`, `rules`, `compare`, `decide`; the tunable fields are `policy.fields`) and
one edge (`observe`, over the operator's Prometheus client). docs/memory-policy.md, Tuning,
derives each rule.
"""
