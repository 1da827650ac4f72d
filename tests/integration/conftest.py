"""Fixtures of the integration tests beyond ``tests/conftest.py``: the Redis Cluster ones (tests/cluster.py),
and clients that keep small values inline (``test_inline.py``, ``test_meta_and_data.py``)."""

import pytest
import torch
from tensordict import TensorDict

from tests.cluster import cluster, cluster_client  # noqa: F401  (registered as fixtures here)
from tests.conftest import make_client

INLINE_LIMIT = 4096
"""``storage.inline_max_bytes`` of the inline clients below."""


@pytest.fixture
def inline_client(server, namespace):
    """A client whose values of at most :data:`INLINE_LIMIT` bytes are kept inline (every server)."""
    c = make_client(server.url, namespace, inline_max_bytes=INLINE_LIMIT)
    yield c
    c.close()


@pytest.fixture
def counted(real_server, namespace):
    """An inline client on a real server, warmed up so that round trips can be counted: the library
    is loaded, the store config read and the default sampler resolved."""
    c = make_client(real_server.url, namespace, inline_max_bytes=INLINE_LIMIT)
    c.put(TensorDict({"x": torch.zeros(1, 1)}, batch_size=[1]), partition_id="warm")
    c.get_meta(["x"], 1, "warm", mode="fetch", task_name="warm")
    yield c
    c.close()
