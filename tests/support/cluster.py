"""`harness.cluster` under the path that tests/support/alerts.py imports."""

from harness.cluster import Cluster, wait_for

__all__ = ["Cluster", "wait_for"]
