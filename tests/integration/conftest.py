"""Fixtures of the integration tests beyond ``tests/conftest.py``: the Redis Cluster ones (tests/cluster.py)."""

from tests.cluster import cluster, cluster_client  # noqa: F401  (registered as fixtures here)
