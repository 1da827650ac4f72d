"""Public-API fuzz (issue 14, deliverable 5): random calls on a real Valkey either round-trip exactly
or raise a ``tq_redis.errors`` type, and the namespace stays consistent with what was stored.

A hypothesis state machine drives ``put`` (insert and rewrite), ``get_meta`` (fetch, force_fetch,
leases), ``get_data``, ``clear_samples``, ``clear_partition`` and the ``kv_*`` calls of one client,
with valid and invalid names, many dtypes (bool, uint8, bfloat16, float16, complex ...), shapes (0-d
samples, empty dimensions, jagged fields), Python objects, NaN payloads, NaN/inf/str timeouts, and
metas from another partition or another namespace (a second client puts there too). A model of what
each namespace holds says what every call must return:

* a call the model says is valid must succeed, and what it reads must equal what was stored (bit for
  bit for tensors: NaN payloads included);
* a call with a bad argument, or that names samples that do not exist (cleared, from another
  namespace), must raise a ``tq_redis.errors.TQError``;
* anything else (a raw ``ValueError``, ``TypeError``, redis-py or msgpack error ...) fails the test.

After every example the namespace is audited: the ``alive`` bitmap of each partition equals the
model's live samples, the ``redis`` store holds a data key for exactly the live (sample, field)
pairs, each field's ``prod`` bits match, and every key fits the layout documented in
:mod:`tq_redis.meta.keys` (no scratch or stray keys). Run with ``-s`` to see the counts; the soak-marked
variant runs many more examples.
"""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test
from tensordict import NonTensorData, NonTensorStack, TensorDict

from tests.conftest import _server, make_client
from tests.records import without_records
from tq_redis import errors
from tq_redis.meta import BatchMeta, bitmaps
from tq_redis.meta.keys import PartitionKeys

# ------------------------------------------------------------------ counts (printed with -s)

COUNTS: Counter[str] = Counter()
TYPED: Counter[str] = Counter()  # "<call>: <error type>" -> how many
CALLS: Counter[str] = Counter()  # "<call>" -> how many


class RawException(AssertionError):
    """A call raised something that is not a ``tq_redis.errors`` type."""


def attempt(label: str, fn, *args, **kwargs) -> tuple[bool, Any]:
    """Run one public call: ``(True, result)`` or ``(False, typed error)``; a raw exception fails."""
    COUNTS["calls"] += 1
    CALLS[label] += 1
    try:
        result = fn(*args, **kwargs)
    except errors.TQError as exc:
        COUNTS["typed errors"] += 1
        TYPED[f"{label}: {type(exc).__name__}"] += 1
        return False, exc
    except Exception as exc:
        COUNTS["other"] += 1
        raise RawException(f"{label} raised a raw {type(exc).__module__}.{type(exc).__name__}: {exc}") from exc
    COUNTS["ok"] += 1
    return True, result


# ------------------------------------------------------------------ values

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
]  # fmt: skip
JAGGED_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
SAMPLE_SHAPES = [(), (1,), (3,), (0,), (2, 0), (2, 3), (1, 1, 2)]

GOOD_PARTITIONS = ["p", "q/1", "train@step:3", "ünï"]
BAD_PARTITIONS = ["", "a b", "x{y}", "__chan__.c", "tab\there", "nul\x00", None, 3]
GOOD_FIELDS = ["x", "y", "obj", "log.prob"]
BAD_FIELDS = ["", "a b", "f{", "nul\x00"]
GOOD_KEYS = ["k0", "k1", "k 2", "ключ", "k:4"]
BAD_KEYS = ["", "ctl\x01", None, 5]
TASKS = ["actor", "ref"]
BAD_SECONDS = [math.nan, math.inf, -1.0, "1", True]


def pick(items: list[Any]) -> st.SearchStrategy[Any]:
    """One of ``items``, evenly (``sampled_from`` leans to the first item)."""
    return st.integers(0, 997).map(lambda k: items[k % len(items)])


def mostly(usual: list[Any], rare: list[Any]) -> st.SearchStrategy[Any]:
    """One of ``usual``, or about one draw in ten one of ``rare`` (the bad values)."""
    return st.integers(0, 99).flatmap(lambda k: pick(rare if k >= 90 else usual))


def random_bytes(gen: torch.Generator, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def dense(gen: torch.Generator, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A batch with random bit patterns (NaNs with payloads, infinities, denormals) of ``dtype``."""
    full = (n, *shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, full, generator=gen).bool()
    count = math.prod(full)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return random_bytes(gen, count * itemsize).view(dtype).reshape(full).clone()


def jagged(gen: torch.Generator, n: int, dtype: torch.dtype, lengths: list[int], tail: int) -> torch.Tensor:
    parts = [dense(gen, 1, (length, tail), dtype)[0] for length in lengths[:n]]
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


OBJECTS = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def same(a: Any, b: Any) -> bool:
    """Exact equality: tensors bit for bit (dtype and shape too), NaN equal to NaN elsewhere."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return False
        return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
            b.contiguous().reshape(-1).view(torch.uint8).numpy()
        )
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def column(value: Any, n: int) -> list[Any]:
    """A returned field as one value per sample."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind()) if value.is_nested else [value[i] for i in range(n)]
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return [value.data] * n
    if isinstance(value, list):
        return value
    raise AssertionError(f"unexpected field type {type(value).__name__}")


# ------------------------------------------------------------------ the model


@dataclass
class Partition:
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)  # live id -> field -> value
    consumed: dict[str, set[int]] = field(default_factory=dict)  # task -> ids handed out
    kv: dict[str, int] = field(default_factory=dict)  # user key -> id (live or not)


@dataclass
class Namespace:
    client: Any
    partitions: dict[str, Partition] = field(default_factory=dict)
    ever: set[str] = field(default_factory=set)  # every partition id that got keys

    def part(self, pid: str) -> Partition:
        self.ever.add(pid)
        return self.partitions.setdefault(pid, Partition())

    def readable(self, pid: Any, ids: list[int], fields: list[str]) -> bool:
        part = self.partitions.get(pid) if isinstance(pid, str) else None
        return part is not None and all(i in part.samples and set(fields) <= part.samples[i].keys() for i in ids)


class ApiFuzz(RuleBasedStateMachine):
    """One example: two fresh namespaces on the shared Valkey, a client each, random calls."""

    def __init__(self) -> None:
        super().__init__()
        url = _server("valkey").url
        self.main = Namespace(make_client(url, f"fz{uuid.uuid4().hex[:10]}"))
        self.other = Namespace(make_client(url, f"fz{uuid.uuid4().hex[:10]}"))
        self.gen = torch.Generator().manual_seed(0)
        self.metas: list[BatchMeta] = []  # from either namespace: foreign metas are fair game

    def teardown(self) -> None:
        try:
            for ns in (self.main, self.other):
                audit(ns)
        finally:
            for ns in (self.main, self.other):
                ns.client.close()

    # -------------------------------------------------------------- building batches

    def _batch(self, data: st.DataObject, n: int) -> tuple[TensorDict | None, dict[str, list[Any]]]:
        """A TensorDict of ``n`` rows with 1-3 fields, and each field's values per sample."""
        self.gen.manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
        fields = data.draw(st.lists(pick(GOOD_FIELDS), min_size=1, max_size=3, unique=True), label="fields")
        columns: dict[str, Any] = {}
        per_sample: dict[str, list[Any]] = {}
        for name in fields:
            kind = data.draw(pick(["dense", "dense", "jagged", "objects"]), label=f"{name} kind")
            if kind == "dense":
                dtype = data.draw(pick(DTYPES), label=f"{name} dtype")
                shape = data.draw(pick(SAMPLE_SHAPES), label=f"{name} shape")
                t = dense(self.gen, n, shape, dtype)
                columns[name], per_sample[name] = t, [t[i] for i in range(n)]
            elif kind == "jagged":
                dtype = data.draw(pick(JAGGED_DTYPES), label=f"{name} dtype")
                lengths = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n), label=f"{name} lengths")
                tail = data.draw(st.integers(1, 3), label=f"{name} tail")
                nt = jagged(self.gen, n, dtype, lengths, tail)
                columns[name], per_sample[name] = nt, list(nt.unbind())
            else:
                values = data.draw(st.lists(OBJECTS, min_size=n, max_size=n), label=f"{name} objects")
                columns[name] = NonTensorStack(*[NonTensorData(v) for v in values])
                per_sample[name] = values
        return TensorDict(columns, batch_size=[n]), per_sample

    def _ns(self, data: st.DataObject) -> Namespace:
        return data.draw(pick([self.main, self.main, self.other]), label="namespace")

    def _meta(self, data: st.DataObject) -> BatchMeta | None:
        if not self.metas:
            return None
        meta = data.draw(pick(self.metas), label="meta")
        if meta.size > 1 and data.draw(st.booleans(), label="subset"):
            keep = data.draw(st.lists(st.integers(0, meta.size - 1), min_size=1, unique=True), label="rows")
            meta = meta.select_samples(sorted(keep))
        return meta

    # -------------------------------------------------------------- rules

    # One rule draws the call evenly by these weights (hypothesis's own rule choice leans hard to
    # the first rules by name); the ones that need a meta wait for one.
    WEIGHTS = {
        "put_new": 4, "rewrite": 2, "get_data": 3, "fetch": 3, "force_fetch": 1, "bad_calls": 1,
        "clear_samples": 1, "clear_partition": 1, "kv_batch_put": 3, "kv_batch_get": 3, "kv_clear": 1,
    }  # fmt: skip
    NEED_META = frozenset({"rewrite", "get_data", "clear_samples"})

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        names = [n for n, w in self.WEIGHTS.items() for _ in range(w) if self.metas or n not in self.NEED_META]
        getattr(self, data.draw(pick(names), label="call"))(data)

    def put_new(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        good = data.draw(st.integers(0, 99), label="name ok") < 90
        pid = data.draw(pick(GOOD_PARTITIONS if good else BAD_PARTITIONS), label="partition")
        n = data.draw(st.integers(1, 4), label="rows")
        td, values = self._batch(data, n)
        twist = data.draw(mostly(["none"], ["2d", "meta device", "bad field"]), label="twist")
        if twist == "2d":
            td = TensorDict({"x": torch.ones(n, 2)}, batch_size=[n, 2])
        elif twist == "meta device":
            td["x"] = torch.empty(n, 2, device="meta")
        elif twist == "bad field":
            td[data.draw(pick(BAD_FIELDS[1:]), label="bad field")] = torch.ones(n)
        ok, meta = attempt("put", ns.client.put, td, partition_id=pid)
        assert ok == (good and twist == "none"), meta
        if ok:
            assert meta.size == n and meta.partition_ids == [pid] * n
            part = ns.part(pid)
            for row, i in enumerate(meta.global_indexes):
                assert i not in part.samples and all(i not in c for c in part.consumed.values()), "id reused"
                part.samples[i] = {name: vals[row] for name, vals in values.items()}
            self.metas.append(meta)

    def rewrite(self, data: st.DataObject) -> None:
        ns, meta = self._ns(data), self._meta(data)
        td, values = self._batch(data, meta.size)
        ok, got = attempt("put(metadata=)", ns.client.put, td, metadata=meta)
        assert ok == all(ns.readable(p, [i], []) for p, i in zip(meta.partition_ids, meta.global_indexes)), got
        if ok:
            for row, (pid, i) in enumerate(zip(meta.partition_ids, meta.global_indexes)):
                ns.partitions[pid].samples[i].update({name: vals[row] for name, vals in values.items()})
            self.metas.append(got)

    def get_data(self, data: st.DataObject) -> None:
        ns, meta = self._ns(data), self._meta(data)
        readable = all(
            ns.readable(pid, [i], meta.field_names) for pid, i in zip(meta.partition_ids, meta.global_indexes)
        )
        ok, out = attempt("get_data", ns.client.get_data, meta)
        assert ok == readable, out
        if ok:
            check_rows(ns, meta.partition_ids, meta.global_indexes, meta.field_names, out)

    def fetch(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        pid = data.draw(pick(GOOD_PARTITIONS), label="partition")
        part = ns.partitions.get(pid, Partition())
        known = sorted({f for s in part.samples.values() for f in s}) or ["x"]
        fields = data.draw(st.lists(pick(known), min_size=1, max_size=2, unique=True), label="fields")
        task = data.draw(pick(TASKS), label="task")
        size = data.draw(st.integers(1, 4), label="batch_size")
        timeout = data.draw(mostly([0, 0.0], BAD_SECONDS), label="timeout")
        lease = data.draw(mostly([None, None, 30.0], BAD_SECONDS), label="lease_s")
        bad_args = timeout in BAD_SECONDS or lease in BAD_SECONDS
        ok, meta = attempt("get_meta", ns.client.get_meta, fields, size, pid, task_name=task,
                           timeout=timeout, lease_s=lease)  # fmt: skip
        if bad_args:
            assert not ok and isinstance(meta, errors.InvalidArgument), meta
            return
        done = part.consumed.get(task, set())
        ready = [i for i, s in part.samples.items() if set(fields) <= s.keys() and i not in done]
        if not ok:  # the only refusal left: fields never put in the partition
            assert isinstance(meta, errors.UnknownField | errors.UnknownPartition) and len(ready) < size, meta
            return
        if len(ready) < size:
            assert meta.size == 0, (meta, ready)
            return
        assert meta.size == size and set(meta.global_indexes) <= set(ready), (meta, ready)
        ns.part(pid).consumed.setdefault(task, set()).update(meta.global_indexes)
        self.metas.append(meta)
        ok, out = attempt("get_data", ns.client.get_data, meta)
        assert ok, out
        check_rows(ns, meta.partition_ids, meta.global_indexes, fields, out)
        if lease is not None:
            ok, settled = attempt("extend_lease", ns.client.extend_lease, meta, 60)
            assert ok and settled is None, settled
            ok, settled = attempt("ack", ns.client.ack, meta)
            assert ok and settled is None, settled

    def force_fetch(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        pid = data.draw(pick(GOOD_PARTITIONS + BAD_PARTITIONS[:3]), label="partition")
        ok, meta = attempt("get_meta(force_fetch)", ns.client.get_meta, [], 1, pid, mode="force_fetch")
        part = ns.partitions.get(pid)
        if ok:
            assert sorted(meta.global_indexes) == sorted(part.samples if part else []), meta
        else:
            assert pid not in GOOD_PARTITIONS or not (part and part.samples), meta

    def bad_calls(self, data: st.DataObject) -> None:
        """Calls that must be refused whatever the state: the typed error, and nothing changes."""
        client = self.main.client
        meta = self._meta(data) or BatchMeta.empty()
        call = data.draw(pick([
            ("clear_samples(None)", client.clear_samples, (None,)),
            ("ack(None)", client.ack, (None,)),
            ("nack(None)", client.nack, (None,)),
            ("extend_lease(inf)", client.extend_lease, (meta, math.inf)),
            ("get_meta([])", client.get_meta, ([], 1, "p"), {"task_name": "actor"}),
            ("get_meta(batch_size=nan)", client.get_meta, (["x"], math.nan, "p"), {"task_name": "actor"}),
            ("kv_retrieve_keys(nan)", client.kv_retrieve_keys, ([math.nan], "p")),
            ("get_data(None)", client.get_data, (None,)),
            ("put(list)", client.put, ([1, 2],), {"partition_id": "p"}),
        ]), label="bad call")  # fmt: skip
        label, fn, args, *kw = call
        ok, exc = attempt(label, fn, *args, **(kw[0] if kw else {}))
        assert not ok, exc

    def clear_samples(self, data: st.DataObject) -> None:
        ns, meta = self._ns(data), self._meta(data)
        ok, exc = attempt("clear_samples", ns.client.clear_samples, meta)
        assert ok, exc
        for pid, i in zip(meta.partition_ids, meta.global_indexes):
            if pid in ns.partitions:
                ns.partitions[pid].samples.pop(i, None)

    def clear_partition(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        good = data.draw(st.integers(0, 99), label="name ok") < 80
        pid = data.draw(pick(GOOD_PARTITIONS if good else BAD_PARTITIONS), label="partition")
        ok, exc = attempt("clear_partition", ns.client.clear_partition, pid)
        assert ok == good, exc
        if ok:
            ns.partitions.pop(pid, None)  # its keys go; ids are never reused

    def kv_batch_put(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        pid = data.draw(mostly(GOOD_PARTITIONS[:2], BAD_PARTITIONS[:2]), label="partition")
        key = mostly(GOOD_KEYS, BAD_KEYS)
        unique = data.draw(st.integers(0, 99), label="unique keys") < 90
        keys = data.draw(st.lists(key, min_size=1, max_size=3, unique=unique), label="keys")
        td, values = self._batch(data, len(keys))
        tags = data.draw(mostly([None, "good"], ["bad"]), label="tags")
        tag_rows = None if tags is None else [{"n": j, "s": "v"} if tags == "good" else {"b": b"x"} for j in keys]
        ok, got = attempt("kv_batch_put", ns.client.kv_batch_put, keys, pid, td, tag_rows)
        valid = pid in GOOD_PARTITIONS and all(k in GOOD_KEYS for k in keys) and len(set(keys)) == len(keys)
        assert ok == (valid and tags != "bad"), got
        if not ok:
            return
        ok, meta = attempt("kv_retrieve_meta", ns.client.kv_retrieve_meta, keys, pid)
        assert ok and meta.size == len(keys), meta
        part = ns.part(pid)
        for row, (key, i) in enumerate(zip(keys, meta.global_indexes)):
            if part.kv.get(key) != i:  # a new key (or one whose sample was cleared): a fresh sample
                assert i not in part.samples, "id reused"
                part.samples[i] = {}
            part.kv[key] = i
            part.samples[i].update({name: vals[row] for name, vals in values.items()})
        self.metas.append(meta)

    def kv_batch_get(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        with_keys = [p for p in GOOD_PARTITIONS[:2] if p in ns.partitions and ns.partitions[p].kv]
        pid = data.draw(pick(with_keys or GOOD_PARTITIONS[:2]), label="partition")
        part = ns.partitions.get(pid, Partition())
        pool = sorted(part.kv) if part.kv and data.draw(st.integers(0, 9), label="known keys") < 8 else GOOD_KEYS
        keys = data.draw(st.lists(pick(pool), min_size=1, max_size=3, unique=True), label="keys")
        ids = [part.kv.get(k, -1) for k in keys]
        live = all(i in part.samples for i in ids)
        fields = sorted(set.intersection(*[set(part.samples[i]) for i in ids])) if live else []
        ok, out = attempt("kv_batch_get", ns.client.kv_batch_get, keys, pid, fields or None)
        if not (live and fields):
            assert not ok or out.batch_size[0] == len(keys), out
            return
        assert ok, out
        check_rows(ns, [pid] * len(ids), ids, fields, out)

    def kv_clear(self, data: st.DataObject) -> None:
        ns = self._ns(data)
        pid = data.draw(pick(GOOD_PARTITIONS[:2]), label="partition")
        key = mostly(GOOD_KEYS, BAD_KEYS[:1])
        keys = data.draw(st.lists(key, min_size=1, max_size=3, unique=True), label="keys")
        ok, exc = attempt("kv_clear", ns.client.kv_clear, keys, pid)
        assert ok == all(k in GOOD_KEYS for k in keys), exc
        part = ns.partitions.get(pid)
        if ok and part is not None:
            for k in keys:
                if k in part.kv:
                    part.samples.pop(part.kv.pop(k), None)



def check_rows(ns: Namespace, pids: list[str], ids: list[int], fields: list[str], out: TensorDict) -> None:
    """What a read returned equals the model, sample by sample, field by field."""
    n = len(ids)
    assert list(out.batch_size) == [n], out.batch_size
    assert set(out.keys()) == set(fields), (list(out.keys()), fields)
    for name in fields:
        got = column(out.get(name), n)
        for row, (pid, i) in enumerate(zip(pids, ids)):
            want = ns.partitions[pid].samples[i][name]
            assert same(got[row], want), f"field {name!r} of sample {i} in {pid!r}: {got[row]!r} != {want!r}"


# ------------------------------------------------------------------ the namespace audit

_GLOBAL = {
    "partitions", "partitions:kept", "channels", "config", "clients", "storage:nodes", "storage:rings",
    "storage:pendingnodes", "storage:epoch",
}  # fmt: skip
_PLAIN = {
    "meta", "seq", "alive", "fields", "tasks", "tagnames", "groups", "groupidx", "kv", "kvkeys", "events",
    "waittasks", "trash", "trashfields", "inline", "dock", "dockstate", "dockmetrics", "dockdone", "dockready",
    "dockage", "rings", "closed", "tagchanges", "counters", "resv", "resvdl", "admission", "admitwaiters",
    "admitwake", "shared", "sharepending", "carriers",
}  # fmt: skip
_FAMILIES = (
    "prod:", "cons:", "lease:", "dlv:", "poison:", "sampled:", "tag:", "loc:",
    "waiters:", "waitneed:", "wake:", "wakebudget:", "rank:", "bal:", "share:",
)  # fmt: skip
_PARTITION_KEY = re.compile(r"\{([^{}]+)\}:(.*)", re.S)
_DATA_KEY = re.compile(r"d:(\d+):(.+)", re.S)


def audit(ns: Namespace) -> None:
    """Redis holds what the model says, in the documented layout, and nothing else."""
    ok, listed = attempt("get_partition_list", ns.client.get_partition_list)
    assert ok and set(ns.partitions) <= set(listed), (ns.partitions.keys(), listed)
    r, prefix = ns.client.redis, ns.client.namespace + ":"
    data_keys: dict[str, set[tuple[int, str]]] = {}
    for raw in r.scan_iter(match=prefix + "*", count=1000):
        rest = raw.decode()[len(prefix):]
        if rest in _GLOBAL or rest.startswith("storage:pending:"):
            continue
        m = _PARTITION_KEY.fullmatch(rest)
        assert m, f"stray key {raw!r}: not in the layout of tq_redis.meta.keys"
        tag, suffix = m.groups()
        owner, _, pid = tag.partition("/")  # the tag is {<namespace>/<partition>}
        assert owner == ns.client.namespace, f"key {raw!r}: its hash tag does not name this namespace"
        if suffix.startswith("rq:"):  # a call's request record (tests/records.py), even of a claim that
            assert not without_records([raw], r)  # found no partition: it must expire
            continue
        assert pid in ns.ever, f"key {raw!r} of partition {pid!r}, which no call created"
        d = _DATA_KEY.fullmatch(suffix)
        if d:
            data_keys.setdefault(pid, set()).add((int(d.group(1)), d.group(2)))
            continue
        assert suffix in _PLAIN or suffix.startswith(_FAMILIES), f"stray key {raw!r} (suffix {suffix!r})"
    for pid in ns.ever:
        pk = PartitionKeys(ns.client.namespace, pid)
        part = ns.partitions.get(pid, Partition())
        alive = set(bitmaps.set_ids(r.get(pk.alive)))
        assert alive == set(part.samples), f"{pid!r}: alive bitmap {sorted(alive)} != model {sorted(part.samples)}"
        stored = {(i, f) for i, fields in part.samples.items() for f in fields}
        assert data_keys.get(pid, set()) == stored, f"{pid!r}: data keys {data_keys.get(pid)} != model {stored}"
        assert not bitmaps.set_ids(r.get(pk.trash)), f"{pid!r}: bytes left in the trash"
        for name in {f for _, f in stored}:
            produced = set(bitmaps.set_ids(r.get(pk.prod(name)))) & alive
            assert produced == {i for i, f in stored if f == name}, f"{pid!r}: prod:{name} bits disagree"


# ------------------------------------------------------------------ the tests


def _run(max_examples: int, steps: int) -> None:
    COUNTS.clear()
    TYPED.clear()
    CALLS.clear()
    try:
        run_state_machine_as_test(
            ApiFuzz,
            settings=settings(
                max_examples=max_examples,
                stateful_step_count=steps,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        print(f"\npublic-API fuzz: {dict(COUNTS)}")
        for label, n in sorted(CALLS.items()):
            typed = {k.split(": ", 1)[1]: v for k, v in TYPED.items() if k.split(": ", 1)[0] == label}
            print(f"  {n:6d} {label}" + (f"  (typed errors: {typed})" if typed else ""))
    assert COUNTS["other"] == 0
    assert COUNTS["calls"] == COUNTS["ok"] + COUNTS["typed errors"]


def test_public_api_fuzz(valkey) -> None:
    """Each call round-trips or raises a tq_redis.errors type; the namespace audit holds."""
    _run(max_examples=30, steps=50)


@pytest.mark.soak
def test_public_api_fuzz_soak(valkey) -> None:
    _run(max_examples=250, steps=60)
