"""Placement of replicated DRAM values: N distinct holders, distinct hosts first, repairs, typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from tq_redis.api import config
from tq_redis.backends.dram.placement import Member, Ring, replicas_of, ring_id
from tq_redis.backends.dram.replicas import holder_ids
from tq_redis.backends.dram.store import DramStore
from tq_redis.errors import ConfigError

KEYS = [f"tq:{{tq/p}}:d:{i}:x" for i in range(2000)]


def _ring(hosts: list[str], replicas: int) -> Ring:
    return Ring([Member(f"n{i}", f"10.0.0.{i}:7700", h) for i, h in enumerate(hosts)], replicas)


def test_every_key_gets_n_distinct_nodes_on_distinct_hosts_when_there_are_enough():
    hosts = ["a", "a", "b", "b", "c"]
    ring = _ring(hosts, 3)
    held = ring.holders(KEYS)
    assert held.shape == (len(KEYS), 3)
    assert all(len(set(row)) == 3 for row in held.tolist())
    host_of = np.array(hosts)
    assert all(len(set(host_of[row])) == 3 for row in held.tolist()), "two copies of a key share a host"
    assert set(held[:, 0].tolist()) == set(range(5)), "some node is never a first holder"


def test_with_fewer_hosts_than_replicas_the_rest_are_distinct_nodes():
    ring = _ring(["a", "a", "a", "b"], 3)
    held = ring.holders(KEYS)
    host_of = np.array(["a", "a", "a", "b"])
    for row in held.tolist():
        assert len(set(row)) == 3
        assert set(host_of[row]) == {"a", "b"}, "a key's copies do not use both hosts"


def test_the_first_holder_is_the_unreplicated_owner_and_the_id_carries_the_count():
    one, two = _ring(["a", "b", "c"], 1), _ring(["a", "b", "c"], 2)
    assert (two.holders(KEYS)[:, 0] == one.owners(KEYS)).all()
    assert one.id == ring_id(["n0", "n1", "n2"]) and replicas_of(one.id) == 1
    assert two.id == one.id + "r2" and replicas_of(two.id) == 2


def test_a_repair_replaces_only_the_dead_node_and_keeps_the_others():
    ring = _ring(["a", "b", "c", "d"], 2)
    before = holder_ids(ring, KEYS)
    fresh = Ring([m for m in ring.links if m.node_id != "n1"] + [Member("n9", "10.0.0.9:7700", "e")], 2)
    after = holder_ids(ring, KEYS, [("n1", fresh)])
    had = (before == "n1").any(axis=1)
    assert had.any() and (after[~had] == before[~had]).all()
    assert not (after == "n1").any()
    assert all(len(set(row)) == 2 for row in after.tolist())
    # computed again (another process) from the same record: the same holders
    assert (holder_ids(ring, KEYS, [("n1", fresh)]) == after).all()


def test_a_ring_smaller_than_its_replica_count_is_refused():
    with pytest.raises(ValueError, match="cannot hold 3 replicas"):
        _ring(["a", "b"], 3).holders(KEYS[:3])


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_replicas_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="storage.replicas"):
        DramStore("redis://127.0.0.1:1", "tq", replicas=bad)
    with pytest.raises(ConfigError, match="storage.replicas must be an integer"):
        config.load({"storage": {"replicas": bad}})


def test_replicas_is_for_the_dram_store_and_given_once():
    with pytest.raises(ConfigError, match="for the dram store"):
        config.load({"storage": {"backend": "redis", "replicas": 2}})
    with pytest.raises(ConfigError, match="disagree"):
        config.load({"storage": {"replicas": 2, "options": {"replicas": 3}}})
    assert config.load({"storage": {"replicas": 2}})["storage"]["replicas"] == 2
    assert config.load({})["storage"]["replicas"] == 1


def test_the_environment_gives_replicas_when_the_config_does_not(monkeypatch):
    monkeypatch.setenv("TQ_STORAGE_REPLICAS", "2")
    assert config.load({})["storage"]["replicas"] == 2
    monkeypatch.setenv("TQ_STORAGE_REPLICAS", "two")
    with pytest.raises(ConfigError, match="TQ_STORAGE_REPLICAS"):
        config.load({})
