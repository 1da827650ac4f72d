"""Typos say so: ``get_meta`` of a partition that does not exist, or of a field no sample has, logs
one warning per (partition, field) per client naming the known ones; the return stays empty."""

from __future__ import annotations

import asyncio
import logging

import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis.ops import typos

LOGGER = "tq_redis.ops.typos"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_get_meta_of_an_unknown_partition_or_field_warns_once_naming_the_known_ones(server, namespace, caplog):
    client = make_client(server.url, namespace)
    other = make_client(server.url, namespace)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        client.put(TensorDict({"prompts": torch.arange(4)}, batch_size=[4]), partition_id="train")
        client.put(TensorDict({"prompts": torch.arange(2)}, batch_size=[2]), partition_id="val")

        assert client.get_meta(["prompts"], 2, "trian", task_name="actor").size == 0
        (said,) = _warnings(caplog)
        assert "partition 'trian' does not exist" in said and "known partitions: ['train', 'val']" in said

        caplog.clear()
        assert client.get_meta(["prompts"], 2, "trian", task_name="actor", timeout=0.2).size == 0
        assert _warnings(caplog) == []  # once per (partition, field) per client

        assert client.get_meta(["promtps"], 2, "train", task_name="actor").size == 0
        (said,) = _warnings(caplog)
        assert "field(s) ['promtps']" in said and "known fields: ['prompts']" in said
        caplog.clear()
        assert asyncio.run(client.async_get_meta(["promtps"], 2, "train", task_name="actor")).size == 0
        assert _warnings(caplog) == []

        # a known field with too few samples ready is "no data yet", not a typo
        assert client.get_meta(["prompts"], 100, "train", task_name="actor").size == 0
        assert _warnings(caplog) == []

        # another client says it again, once
        assert other.get_meta(["promtps"], 2, "train", task_name="actor").size == 0
        assert len(_warnings(caplog)) == 1
    finally:
        client.close()
        other.close()


def test_a_claim_that_returns_samples_never_checks(server, namespace, monkeypatch):
    calls = []
    original = typos.warn_unknown

    def counting(ctx, pk, fields):
        calls.append((pk.partition, tuple(fields)))
        return (yield from original(ctx, pk, fields))

    monkeypatch.setattr(typos, "warn_unknown", counting)
    client = make_client(server.url, namespace)
    try:
        client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]), partition_id="p")
        for _ in range(4):
            assert client.get_meta(["x"], 2, "p", task_name="t").size == 2
        assert calls == []
        assert client.get_meta(["x"], 2, "p", task_name="t").size == 0  # drained: checked once
        assert client.get_meta(["x"], 2, "p", task_name="t").size == 0
        assert len(calls) == 2 and len(client.context.checked_claims) == 1
    finally:
        client.close()
