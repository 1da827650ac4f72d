"""The store registry: names map to lazily imported classes; failures say what to do."""

from __future__ import annotations

import json
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tq_redis import TransferQueueClient
from tq_redis.errors import BackendNotInstalled, ConfigError, DataMissing
from tq_redis.meta.keys import config_key
from tq_redis.storage import base
from tq_redis.storage.base import Buffer, Segments, StoreContext, create_store, join_segments, register_store


class DictStore:
    """A minimal custom store (a process-local dict), registered by the tests below."""

    name = "dict-test"
    data: dict[str, bytes] = {}
    lock = threading.Lock()
    instances: list[DictStore] = []

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.closed = False
        DictStore.instances.append(self)

    @classmethod
    def from_config(cls, options: dict[str, Any], ctx: StoreContext) -> DictStore:
        return cls(f"{ctx.namespace}/{options.get('tag', '')}")

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        with self.lock:
            self.data.update((k, join_segments(v)) for k, v in zip(keys, values))

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        with self.lock:
            missing = [k for k in keys if k not in self.data]
            if missing:
                raise DataMissing(f"missing from the dict store: {missing}")
            return [self.data[k] for k in keys]

    def delete(self, keys: Sequence[str]) -> None:
        with self.lock:
            for k in keys:
                self.data.pop(k, None)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, tuple[str, str | None]]]:
    """A private copy of the registry, so registrations here do not leak into other tests."""
    copy = dict(base._REGISTRY)
    monkeypatch.setattr(base, "_REGISTRY", copy)
    yield copy


def test_unknown_name_lists_the_choices(registry: dict) -> None:
    with pytest.raises(ConfigError) as info:
        create_store("no-such-store", {}, StoreContext("redis://127.0.0.1:1", "ns"))
    message = str(info.value)
    assert "no-such-store" in message
    for name in ("redis", "dram", "fsspec", "ray", "mooncake", "yuanrong"):
        assert repr(name) in message
    assert "register_store" in message


def test_missing_module_names_the_package(registry: dict) -> None:
    register_store("absent", f"tq_redis_no_such_module_{uuid.uuid4().hex}:Store", package="tq-absent-store")
    with pytest.raises(BackendNotInstalled, match=r"pip install tq-absent-store") as info:
        create_store("absent", {}, StoreContext("redis://127.0.0.1:1", "ns"))
    assert "'absent'" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_failing_dependency_import_names_the_package(
    registry: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's module exists but the library it wraps is not installed."""
    module = f"tq_fake_store_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("import tq_library_that_is_not_installed\n\nclass Store: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_store("fake", f"{module}:Store", package="fake-store-lib>=1.2")
    with pytest.raises(BackendNotInstalled) as info:
        create_store("fake", {}, StoreContext("redis://127.0.0.1:1", "ns"))
    assert "pip install fake-store-lib>=1.2" in str(info.value)
    assert "tq_library_that_is_not_installed" in str(info.value)  # says what was missing
    sys.modules.pop(module, None)


def test_shipped_stores_without_a_package_say_reinstall(registry: dict) -> None:
    register_store("broken-builtin", f"tq_redis.backends.no_such_{uuid.uuid4().hex[:6]}:Store")
    with pytest.raises(BackendNotInstalled, match="reinstall tq-redis"):
        create_store("broken-builtin", {}, StoreContext("redis://127.0.0.1:1", "ns"))


def test_registered_names_include_the_shipped_stores() -> None:
    assert {"redis", "dram", "fsspec", "ray"} <= set(base.registered_stores())
    assert base.store_class("fsspec").__name__ == "FsspecStore"
    assert base.store_class("ray").__name__ == "RayStore"


def test_custom_store_end_to_end(registry: dict, redis_url: str) -> None:
    """register_store -> the namespace's config names it -> the real client stores through it."""
    register_store("dict-test", f"{__name__}:DictStore")
    namespace = f"reg-{uuid.uuid4().hex[:8]}"
    store = create_store("dict-test", {"tag": "direct"}, StoreContext(redis_url, namespace))
    assert isinstance(store, DictStore) and store.tag == f"{namespace}/direct"

    client = TransferQueueClient(redis_url, namespace, nested_output=False)  # compare dense tensors
    try:
        spec = {"backend": "dict-test", "options": {"tag": "client"}, "inline_max_bytes": 0}  # all through it
        client.redis.hset(config_key(namespace), "storage", json.dumps(spec))
        td = TensorDict({"x": torch.arange(12).reshape(4, 3), "y": torch.randn(4)}, batch_size=[4])
        client.put(td, partition_id="p")
        meta = client.get_meta(["x", "y"], 4, "p", task_name="t")
        out = client.get_data(meta)
        order = list(meta.global_indexes)
        assert torch.equal(out["x"], td["x"][order]) and torch.equal(out["y"], td["y"][order])
        used = [s for s in DictStore.instances if s.tag == f"{namespace}/client"]
        assert len(used) == 1  # the client built the store from the config in Redis
        assert any(k.startswith(f"{namespace}:{{{namespace}/p}}:d:") for k in DictStore.data)
        client.clear_partition("p")
        assert not any(k.startswith(f"{namespace}:") for k in DictStore.data)
    finally:
        client.close()
    assert used[0].closed
