"""The store conformance suite: every test runs against every store we ship (see ``conftest.py``).

What a store must do is stated in :class:`tq_redis.storage.base.StorageClient`: ``put`` many
keys whose values are segment lists (stored value = their concatenation), ``get`` many keys in
order (``DataMissing`` naming the absent ones), idempotent ``delete``, thread safety, and being
built from config by name. The last case drives each store through the real client.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.conformance.conftest import SETUPS, STORE_BACKENDS, StoreSetup, stop_store_servers
from tq_redis import TransferQueueClient
from tq_redis.errors import ConfigError, DataMissing
from tq_redis.meta.keys import PartitionKeys, config_key
from tq_redis.storage.base import Buffer, Segments, StorageClient, registered_stores


@pytest.fixture(scope="module", autouse=True)
def _store_servers_stop_after_this_module():
    """Mooncake's and Yuanrong's servers poll busily: once these cases are done, the rest of the
    suite does not share the CPU with them."""
    yield
    stop_store_servers()


#: registered stores whose conformance setup lives with their own (parallel) work; drop on arrival
PENDING: set[str] = set()


def _keys(setup: StoreSetup, n: int, field: str = "f") -> list[str]:
    """``n`` fresh keys shaped like the storage manager's (braces and colons included)."""
    pk = PartitionKeys(setup.namespace, f"t{uuid.uuid4().hex[:8]}")
    return [pk.data(i, field) for i in range(n)]


def _value(i: int, n: int = 16) -> tuple[Segments, bytes]:
    """A header + a non-byte-format view of a tensor's memory, and the bytes they must store."""
    header = f"hdr{i}|".encode()
    tensor = torch.arange(n, dtype=torch.int64) + i * 1000
    return [header, tensor.numpy().data], header + tensor.numpy().tobytes()


def _as_bytes(value: Buffer) -> bytes:
    return bytes(value)


def test_every_registered_store_is_covered() -> None:
    covered = {STORE_BACKENDS[s] for s in SETUPS}
    assert set(registered_stores()) - covered <= PENDING, "add a setup to tests/conformance/conftest.py"


def test_implements_the_protocol(store: StorageClient, store_setup: StoreSetup) -> None:
    assert isinstance(store, StorageClient)
    assert store.name == store_setup.backend


def test_round_trip_many_keys(store: StorageClient, store_setup: StoreSetup) -> None:
    keys = _keys(store_setup, store_setup.many)
    pairs = [_value(i, n=1 + (i * 37) % 300) for i in range(len(keys))]
    three: Segments = [b"head", torch.randn(3, 5).numpy().data, b"tail"]  # a 2-D float view in the middle
    pairs[7] = (three, b"".join(memoryview(s).tobytes() for s in three))
    store.put(keys, [segments for segments, _ in pairs])
    got = store.get(keys)
    assert len(got) == len(keys)
    assert [_as_bytes(v) for v in got] == [expected for _, expected in pairs]
    order = list(range(len(keys)))
    random.Random(0).shuffle(order)
    assert [_as_bytes(v) for v in store.get([keys[i] for i in order])] == [pairs[i][1] for i in order]


def test_large_value_next_to_small_ones(store: StorageClient, store_setup: StoreSetup) -> None:
    keys = _keys(store_setup, 3)
    big = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8)
    small, small_bytes = _value(1)
    store.put(keys, [small, [b"big-header", big.numpy().data], [b"x"]])
    got = store.get(keys)
    assert _as_bytes(got[0]) == small_bytes
    assert len(got[1]) == len(b"big-header") + (8 << 20)
    assert _as_bytes(got[1]) == b"big-header" + big.numpy().tobytes()
    assert _as_bytes(got[2]) == b"x"


def test_overwrite(store: StorageClient, store_setup: StoreSetup) -> None:
    keys = _keys(store_setup, 4)
    store.put(keys, [_value(i, n=64)[0] for i in range(4)])
    store.put(keys[1:3], [[b"short"], [b"a", b"longer-than-before" * 100]])
    got = [_as_bytes(v) for v in store.get(keys)]
    assert got == [_value(0, n=64)[1], b"short", b"a" + b"longer-than-before" * 100, _value(3, n=64)[1]]


def test_missing_key_is_named_and_harms_nothing(store: StorageClient, store_setup: StoreSetup) -> None:
    present = _keys(store_setup, 2)
    absent = _keys(store_setup, 1, field="never_written")[0]
    store.put(present, [[b"a"], [b"b"]])
    with pytest.raises(DataMissing) as info:
        store.get([present[0], absent, present[1]])
    assert absent in str(info.value)
    assert present[0] not in str(info.value) and present[1] not in str(info.value)
    assert isinstance(info.value, KeyError)
    assert [_as_bytes(v) for v in store.get(present)] == [b"a", b"b"]


def test_delete_is_idempotent(store: StorageClient, store_setup: StoreSetup) -> None:
    keys = _keys(store_setup, 3)
    store.put(keys, [[b"1"], [b"2"], [b"3"]])
    store.delete([keys[0], keys[1], _keys(store_setup, 1, field="absent")[0]])
    store.delete(keys[:2])
    store.delete([])
    with pytest.raises(DataMissing):
        store.get(keys[:1])
    assert [_as_bytes(v) for v in store.get(keys[2:])] == [b"3"]
    store.put(keys[:1], [[b"again"]])  # a deleted key can be written again
    assert [_as_bytes(v) for v in store.get(keys[:1])] == [b"again"]


def test_empty_values_and_empty_calls(store: StorageClient, store_setup: StoreSetup) -> None:
    keys = _keys(store_setup, 4)
    store.put(keys, [[b""], [], [b"", memoryview(b"")], [np.empty(0, np.float32).data]])
    assert [_as_bytes(v) for v in store.get(keys)] == [b""] * 4
    store.put([], [])
    assert store.get([]) == []


def test_concurrent_threads_never_mix_values(store: StorageClient, store_setup: StoreSetup) -> None:
    threads, per_thread, rounds = 8, max(4, store_setup.many // 8), 3
    keys = [_keys(store_setup, per_thread) for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def expected(t: int, r: int, i: int) -> bytes:
        return f"t{t}r{r}i{i}|".encode() * (1 + (t + i) % 7)

    def work(t: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                store.put(keys[t], [[expected(t, r, i)[:5], expected(t, r, i)[5:]] for i in range(per_thread)])
                got = store.get(keys[t])
                assert [_as_bytes(v) for v in got] == [expected(t, r, i) for i in range(per_thread)], (t, r)
                other = (t + 1) % threads  # read a neighbour's keys while it writes them
                try:
                    for i, v in enumerate(store.get(keys[other])):
                        assert _as_bytes(v) in {expected(other, rr, i) for rr in range(rounds)}, (t, other, i)
                except DataMissing:
                    pass  # the neighbour has not written yet
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors[0]
    assert not any(w.is_alive() for w in workers)


def test_built_from_config_by_name(store_setup: StoreSetup) -> None:
    """Two stores built independently from the same config see the same data."""
    writer, reader = store_setup.create(), store_setup.create()
    try:
        keys = _keys(store_setup, 5)
        writer.put(keys, [_value(i)[0] for i in range(5)])
        assert [_as_bytes(v) for v in reader.get(keys)] == [_value(i)[1] for i in range(5)]
        reader.delete(keys)
        with pytest.raises(DataMissing):
            writer.get(keys)
    finally:
        writer.close()
        reader.close()


def test_end_to_end_through_the_client(store_setup: StoreSetup) -> None:
    client = TransferQueueClient(store_setup.url, store_setup.namespace)
    try:
        # inline_max_bytes 0: every value goes through the store under test (none stays in Redis)
        spec = {"backend": store_setup.backend, "options": store_setup.options, "inline_max_bytes": 0}
        client.redis.hset(config_key(store_setup.namespace), "storage", json.dumps(spec))
        partition = f"e2e-{uuid.uuid4().hex[:6]}"
        td = TensorDict(
            {
                "input_ids": torch.arange(8 * 32).reshape(8, 32),
                "reward": torch.randn(8),
                "logp": torch.randn(8, 32, dtype=torch.bfloat16),
            },
            batch_size=[8],
        )
        client.put(td, partition_id=partition)
        meta = client.get_meta(["input_ids", "reward", "logp"], 8, partition, task_name="train")
        assert meta.size == 8
        out = client.get_data(meta)
        order = list(meta.global_indexes)
        for name in ("input_ids", "reward", "logp"):
            got = out[name]  # the default layout: nested for per-sample dims, dense for scalars
            assert got.is_nested == (td[name].ndim > 1), name
            assert torch.equal(got.to_padded_tensor(0) if got.is_nested else got, td[name][order]), name

        store = store_setup.create()
        try:
            pk = PartitionKeys(store_setup.namespace, partition)
            keys = [pk.data(i, "input_ids") for i in order]
            assert len(store.get(keys)) == 8  # the values really live in this store
            client.clear_partition(partition)
            with pytest.raises(DataMissing):
                store.get(keys[:1])  # and clearing freed them
        finally:
            store.close()
    finally:
        client.close()


# ---------------------------------------------------------------------------- store-specific options


def test_fsspec_needs_a_url() -> None:
    from tq_redis.backends.fsspec_store import FsspecStore
    from tq_redis.storage.base import StoreContext

    with pytest.raises(ConfigError, match="url"):
        FsspecStore.from_config({}, StoreContext("redis://x", "ns"))
    with pytest.raises(ConfigError, match="bogus"):
        FsspecStore.from_config({"url": "memory://x", "bogus": 1}, StoreContext("redis://x", "ns"))


def test_fsspec_key_names_are_safe_and_reversible() -> None:
    from tq_redis.backends.fsspec_store import key_to_name, name_to_key

    for key in ["tq:{p0}:d:7:obs", ".x", "a/b\\c*?[d]~%é", "x" * 500]:
        name = key_to_name(key)
        assert all(c.isalnum() or c in "_.-~" for c in name) and not name.startswith(".")
        assert len(name) <= 255
        if len(key) < 60:
            assert name_to_key(name) == key
    assert key_to_name("x" * 500) != key_to_name("x" * 499)


def test_fsspec_local_writes_are_atomic(tmp_path) -> None:
    """A reader racing overwrites sees an old or a new value, never a torn one; no temp files stay."""
    from tq_redis.backends.fsspec_store import FsspecStore

    store = FsspecStore(f"file://{tmp_path}")
    values = [bytes([n]) * (1 << 20) for n in range(2)]
    store.put(["k"], [[values[0]]])
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            n ^= 1
            store.put(["k"], [[values[n][:1000], memoryview(values[n])[1000:]]])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(50):
            assert _as_bytes(store.get(["k"])[0]) in values
    finally:
        stop.set()
        writer.join()
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []


def test_fsspec_other_filesystems_write_segments() -> None:
    """A synchronous non-local filesystem (fsspec's memory://) goes through fs.open + write."""
    from tq_redis.backends.fsspec_store import FsspecStore

    store = FsspecStore(f"memory://tq-{uuid.uuid4().hex[:6]}")
    store.put(["a:{p}:1", "b"], [[b"x", memoryview(b"yz")], []])
    assert [_as_bytes(v) for v in store.get(["a:{p}:1", "b"])] == [b"xyz", b""]
    with pytest.raises(DataMissing, match="nope"):
        store.get(["nope"])
    store.delete(["a:{p}:1", "nope"])
    with pytest.raises(DataMissing):
        store.get(["a:{p}:1"])


def test_ray_owner_option_is_checked() -> None:
    from tq_redis.backends.ray_store import RayStore
    from tq_redis.storage.base import StoreContext

    with pytest.raises(ConfigError, match="owner"):
        RayStore.from_config({"owner": "nobody"}, StoreContext("redis://x", "ns"))
    with pytest.raises(ConfigError, match="bogus"):
        RayStore.from_config({"bogus": 1}, StoreContext("redis://x", "ns"))


def test_ray_values_outlive_their_writer(ray_setup: StoreSetup) -> None:
    """Another Ray process writes, then dies: table-owned values stay, writer-owned ones are lost."""
    import ray

    ctx = ray_setup.ctx

    class Writer:
        def put(self, options: dict, keys: list[str], values: list[bytes]) -> None:
            from tq_redis.storage.base import create_store

            create_store("ray", options, ctx).put(keys, [[v] for v in values])

    table_keys, writer_keys = _keys(ray_setup, 2), _keys(ray_setup, 1)
    writer: Any = ray.remote(Writer).options(num_cpus=0).remote()
    ray.get(writer.put.remote(ray_setup.options, table_keys, [b"small", bytes(2 << 20)]))
    ray.get(writer.put.remote({**ray_setup.options, "owner": "writer"}, writer_keys, [bytes(2 << 20)]))
    store = ray_setup.create()
    assert [len(v) for v in store.get(table_keys + writer_keys)] == [5, 2 << 20, 2 << 20]
    ray.kill(writer)
    assert [_as_bytes(v)[:5] for v in store.get(table_keys)] == [b"small", bytes(5)]
    deadline = time.monotonic() + 20  # the owner's death reaches this process asynchronously
    with pytest.raises(DataMissing, match="lost") as info:
        while time.monotonic() < deadline:
            store.get(writer_keys)
            time.sleep(0.1)
    assert writer_keys[0] in str(info.value)


_WRITER = """
import json, sys
from tq_redis.storage.base import StoreContext, create_store
spec = json.loads(sys.argv[1])
store = create_store(spec["backend"], spec["options"], StoreContext(spec["url"], spec["namespace"]))
store.put(spec["keys"], [[v.encode()] for v in spec["values"]])
store.close()
"""


@pytest.mark.parametrize("store_id", ["mooncake", "yuanrong"])
def test_values_outlive_their_writer_process(store_id: str, setup_of: Callable[[str], StoreSetup]) -> None:
    """Another process writes and exits; its values stay in the store's servers for this one to read."""
    setup = setup_of(store_id)
    keys = _keys(setup, 3)
    values = ["a", "bb" * 1000, ""]
    spec = {"backend": setup.backend, "options": setup.options, "url": setup.url, "namespace": setup.namespace}
    spec.update(keys=keys, values=values)
    subprocess.run([sys.executable, "-c", _WRITER, json.dumps(spec)], check=True, timeout=120, capture_output=True)
    store = setup.create()
    try:
        assert [_as_bytes(v) for v in store.get(keys)] == [v.encode() for v in values]
        store.delete(keys)
    finally:
        store.close()


def test_mooncake_and_yuanrong_check_their_options() -> None:
    from tq_redis.backends.mooncake import MooncakeStore
    from tq_redis.backends.yuanrong import YuanrongStore
    from tq_redis.storage.base import StoreContext

    ctx = StoreContext("redis://x", "ns")
    with pytest.raises(ConfigError, match="master_server_address"):
        MooncakeStore.from_config({}, ctx)
    with pytest.raises(ConfigError, match="bogus"):
        MooncakeStore.from_config({"master_server_address": "127.0.0.1:1", "bogus": 1}, ctx)
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeStore.from_config({"master_server_address": "127.0.0.1:1", "global_segment_size": "lots"}, ctx)
    with pytest.raises(ConfigError, match="worker_address"):
        YuanrongStore.from_config({}, ctx)
    with pytest.raises(ConfigError, match="bogus"):
        YuanrongStore.from_config({"worker_address": "127.0.0.1:1", "bogus": 1}, ctx)


def test_mooncake_and_yuanrong_name_an_unreachable_server() -> None:
    from tq_redis.errors import StorageUnavailable
    from tq_redis.server.embedded import free_port
    from tq_redis.storage.base import StoreContext, create_store

    ctx = StoreContext("redis://x", "ns")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match=f"master at {address}"):
        create_store("mooncake", {"master_server_address": address}, ctx)
    with pytest.raises(StorageUnavailable, match=f"worker at {address}"):
        create_store("yuanrong", {"worker_address": address}, ctx)
    assert time.monotonic() - started < 5  # told at once, not after the libraries' own retries


@pytest.mark.parametrize(("backend", "package"), [("mooncake", "mooncake-transfer-engine"),
                                                  ("yuanrong", "openyuanrong-datasystem")])  # fmt: skip
def test_mooncake_and_yuanrong_name_their_package(backend: str, package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tq_redis.errors import BackendNotInstalled
    from tq_redis.storage import base

    library = {"mooncake": "mooncake.store", "yuanrong": "yr.datasystem"}[backend]
    monkeypatch.setitem(sys.modules, library, None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, f"tq_redis.backends.{backend}", raising=False)
    with pytest.raises(BackendNotInstalled, match=package):
        base.store_class(backend)
    monkeypatch.undo()  # the working modules are back


def test_yuanrong_keys_are_escaped_injectively() -> None:
    from tq_redis.backends.yuanrong import stored_key

    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_!@#%^*()+=:;")
    keys = ["tq:{p0}:d:7:obs", "tq:%7Bp0}:d:7:obs", "a#b", "a%23b", "é/ ~", "x" * 300, "x" * 299]
    names = [stored_key(k) for k in keys]
    assert len(set(names)) == len(keys)
    assert all(set(n) <= allowed and len(n) <= 255 for n in names)
    assert stored_key("tq:{p0}:d:7:obs") == "tq:%7Bp0%7D:d:7:obs"
