"""An argument-less ``init()`` inside a Ray job attaches to the system the job already started.

verl's workers and the reference's tutorial 06 call ``tq.init()`` in Ray tasks and actors and
expect to see the driver's partitions, as the reference's workers find its controller actor.
"""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

from tests.ray_start import init_local_ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_job():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def driver_system(ray_job, monkeypatch):
    import tq_redis as tq

    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    monkeypatch.delenv("TQ_NAMESPACE", raising=False)
    tq.close()
    cfg = tq.init({"storage": {"units": 1}})
    yield cfg
    tq.close()


def _worker_put_and_read(partition: str) -> dict:
    import tq_redis as tq

    cfg = tq.init()  # no URL, no environment: must find the driver's system
    client = tq.get_client()
    client.put(TensorDict({"x": torch.arange(3)}, batch_size=[3]), partition_id=partition)
    seen = client.get_partition_list()
    tq.close()
    return {"url": cfg["redis"]["url"], "namespace": cfg["namespace"], "seen": seen}


def test_worker_init_attaches_to_the_drivers_system(driver_system):
    import tq_redis as tq

    tq.get_client().put(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), partition_id="from_driver")
    result = ray.get(ray.remote(_worker_put_and_read).remote("from_worker"))
    assert result["url"] == driver_system["redis"]["url"]
    assert result["namespace"] == driver_system["namespace"]
    assert "from_driver" in result["seen"]  # the worker sees the driver's partitions
    meta = tq.get_client().get_meta(["x"], 3, "from_worker", task_name="t")
    assert meta.size == 3  # and the driver sees the worker's data


def test_an_actor_shares_the_system_too(driver_system):
    @ray.remote
    class Rank:
        def run(self) -> dict:
            return _worker_put_and_read("from_actor")

    rank = Rank.remote()
    assert ray.get(rank.run.remote())["url"] == driver_system["redis"]["url"]
    ray.kill(rank)


def test_close_withdraws_the_published_system(ray_job, monkeypatch):
    import tq_redis as tq
    from tq_redis.server import ray_discovery

    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    tq.close()
    cfg = tq.init({"storage": {"units": 1}})
    assert ray_discovery.lookup() == {"url": cfg["redis"]["url"], "namespace": cfg["namespace"]}
    tq.close()
    assert ray_discovery.lookup() is None


def _worker_init_url() -> str:
    import tq_redis as tq

    url = tq.init()["redis"]["url"]
    tq.close()
    return url


def test_an_explicit_url_wins_over_the_published_one(driver_system, valkey):
    task = ray.remote(_worker_init_url).options(runtime_env={"env_vars": {"TQ_REDIS_URL": valkey.url}})
    assert ray.get(task.remote()) == valkey.url != driver_system["redis"]["url"]


def test_a_dock_and_a_channel_in_ray_actors_find_the_jobs_system(driver_system):
    """MindSpeed-RL builds ``ray.remote(GRPOTransferDock)`` with no Redis settings at all."""
    import tq_redis as tq

    dock = ray.remote(tq.GRPOTransferDock).remote(4, 1)
    ray.get(dock.put_experience.remote(TensorDict({"prompts": torch.arange(8).reshape(4, 2)}, [4]),
                                       indexes=[0, 1, 2, 3]))
    batch, indexes = ray.get(dock.get_experience.remote("actor_rollout", ["prompts"], 4, get_n_samples=False))
    assert sorted(indexes) == [0, 1, 2, 3] and batch["prompts"].shape == (4, 2)

    @ray.remote
    def produce() -> None:
        channel = tq.Channel.create("from_ray")
        channel.put({"step": 1}, weight=1)
        channel.close()

    ray.get(produce.remote())
    assert tq.Channel.connect("from_ray").get_nowait() == {"step": 1}  # the driver sees it
    ray.kill(dock)
