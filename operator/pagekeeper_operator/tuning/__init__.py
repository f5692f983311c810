"""The memory policy tunes itself: metric windows in, recommendations out, canary trials decided.

Pure modules (`fields`, `window`, `rules`, `compare`, `decide`) and one edge (`observe`, over the
operator's Prometheus client). docs/memory-policy.md, Tuning, derives each rule.
"""
