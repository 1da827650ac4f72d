"""Debug logs on the paths a hung consumer is debugged on: claims, waits and store calls.

Off by default; ``TQ_LOGGING_LEVEL=DEBUG`` (or ``logging.getLogger("tq_redis").setLevel(DEBUG)``)
turns them on. Each logger is named after its module, so ``tq_redis.ops.claim`` or
``tq_redis.storage`` can be turned on alone.
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict


def _lines(caplog, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.DEBUG]


def test_claims_waits_and_store_calls_are_logged_at_debug(real_client, caplog):
    with caplog.at_level(logging.DEBUG, logger="tq_redis"):
        assert real_client.get_meta(["x"], 4, "p", task_name="t", timeout=0.2).size == 0
        real_client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]), partition_id="p")
        meta = real_client.get_meta(["x"], 4, "p", task_name="t", lease_s=30)
        real_client.get_data(meta)
    claims = _lines(caplog, "tq_redis.ops.claim")
    assert any(line.startswith("claim p/t: nothing ready for 4 sample(s) of ['x']; waiting up to") for line in claims)
    assert "claim p/t: nothing ready after waiting 0.2 s" in claims
    assert "claim p/t: 4 of 4 sample(s), ids 0-3, leased 30.0 s" in claims
    stores = _lines(caplog, "tq_redis.storage.manager")
    assert any(line.startswith("store redis put p: 4 value(s), ") for line in stores), stores
    assert any(line.startswith("store redis get p: 4 value(s), ") for line in stores), stores


def test_nothing_is_logged_below_warning_by_default(real_client, caplog):
    with caplog.at_level(logging.WARNING, logger="tq_redis"):
        real_client.put(TensorDict({"x": torch.arange(2)}, batch_size=[2]), partition_id="q")
        real_client.get_data(real_client.get_meta(["x"], 2, "q", task_name="t"))
    assert [r for r in caplog.records if r.name.startswith("tq_redis")] == []


def test_every_logger_of_the_package_is_named_after_its_module():
    import re
    from pathlib import Path

    import tq_redis

    root = Path(tq_redis.__file__).parent
    named = {
        p.relative_to(root).as_posix(): re.findall(r"logging\.getLogger\(([^)]*)\)", p.read_text(encoding="utf-8"))
        for p in root.rglob("*.py")
    }
    others = {path: args for path, args in named.items() if set(args) - {"__name__"}}
    # logs.get_logger takes the caller's name; the demo quiets one of torch's loggers
    assert others == {"logs.py": ["name"], "demo/stages.py": ['"torch.fx._symbolic_trace"']}
