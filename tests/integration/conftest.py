"""Fixtures of the integration tests beyond ``tests/conftest.py``: the Redis Cluster ones (tests/cluster.py),
clients that keep small values inline (``test_inline.py``, ``test_meta_and_data.py``), a client of a real
server with a snapshot of its namespace's keys, and a local Ray for a test module."""

import os

import pytest
import torch
from tensordict import TensorDict

from tests.cluster import cluster, cluster_client  # noqa: F401  (registered as fixtures here)
from tests.conftest import make_client
from tests.ray_start import init_local_ray
from tq_redis.client.checkpoint import namespace_keys


@pytest.fixture
def rclient(real_server, namespace):
    """A client of a real server (both flavours)."""
    c = make_client(real_server.url, namespace)
    yield c
    c.close()


def key_snapshot(client) -> dict[str, bytes]:
    """Every key of the client's namespace (the redis store's values included) with its serialized value."""
    r = client.redis
    return {k: r.dump(k) for k in namespace_keys(r, client.namespace, with_data=True) if r.exists(k)}


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for the test module (left running if something else started it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)
    yield ray
    if started:
        ray.shutdown()

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
