"""The samplers against a pure-Python model of their semantics.

The model below states the selection rules of ``lua/includes/samplers.lua`` over a plain sorted
list of ready ids; hypothesis builds random partitions (inserts of random sizes, a second field
produced for a random subset, random consumption, clears and tags) on each server flavour and
checks that the claim script picks exactly what the model picks, with the same side effects
(samples put aside in the poison set). The Python ``sample()`` of the built-in classes and the
balancing are checked against the same model.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import errors
from tq_redis.meta import BatchMeta
from tq_redis.ops.claim_plan import builtin_plan
from tq_redis.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    PartitioningError,
    PrioritizedSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    get_seqlen_balanced_partitions,
    is_builtin,
    karmarkar_karp,
    resolve_sampler,
    sampler_from_spec,
    sampler_spec,
)

TOKEN_LOOKAHEAD = 64  # units that may not fit in a row before a budgeted scan stops

# ------------------------------------------------------------------ the model


@dataclass
class World:
    """A partition as the model sees it."""

    inserts: list[tuple[int, int]]  # (first id, count) per put
    ready: list[int]  # alive, fields produced, not consumed by the task (ascending)
    lengths: dict[int, int] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    uids: dict[int, str] = field(default_factory=dict)
    has_uid_tag: bool = False
    deliveries: dict[int, int] = field(default_factory=dict)


@dataclass
class Options:
    n: int = 1
    max_tokens: int = 0
    min_version: int | None = None
    drop_stale: bool = False
    max_deliveries: int = 0


def model_select(world: World, want: int, o: Options) -> tuple[list[int], set[int]]:
    """Ids handed out and ids put aside, by the rules in lua/includes/samplers.lua."""
    by_uid = o.n > 1 and world.has_uid_tag
    aside: set[int] = set()
    verdict: dict[int, bool] = {}

    def examine(x: int) -> bool:
        if x in verdict:
            return verdict[x]
        ok = True
        if o.max_deliveries and world.deliveries.get(x, 0) >= o.max_deliveries:
            aside.add(x)
            ok = False
        if ok and o.min_version is not None:
            v = world.versions.get(x)
            if v is None:
                ok = False
            elif v < o.min_version:
                if o.drop_stale:
                    aside.add(x)
                ok = False
        if ok and o.max_tokens and x not in world.lengths:
            ok = False
        if ok and by_uid and x not in world.uids:
            ok = False
        verdict[x] = ok
        return ok

    def insert_of(x: int) -> tuple[int, int] | None:
        return next(((f, c) for f, c in world.inserts if f <= x < f + c), None)

    def units() -> Iterator[list[int]]:
        ready = world.ready
        if o.n == 1:
            for x in ready:
                if examine(x):
                    yield [x]
            return
        if by_uid:
            buckets: dict[str, list[int]] = {}
            for x in ready:
                if examine(x):
                    bucket = buckets.setdefault(world.uids[x], [])
                    bucket.append(x)
                    if len(bucket) == o.n:
                        del buckets[world.uids[x]]
                        yield bucket
            return
        i = 0
        while i < len(ready):
            x = ready[i]
            i += 1
            ok = examine(x)
            f, c = insert_of(x) or (None, None)
            if f is None:
                continue
            g = f + (x - f) // o.n * o.n
            if x != g or g + o.n > f + c:
                continue
            members = [x]
            for j in range(1, o.n):
                if i >= len(ready):
                    return  # the stream ended inside a group
                if ready[i] != g + j:
                    break
                members.append(ready[i])
                ok = examine(ready[i]) and ok
                i += 1
            if len(members) == o.n and ok:
                yield members

    out: list[int] = []
    tokens = misses = 0
    stream = units()
    while len(out) < want:  # the next unit is only looked for while the batch is not full
        unit = next(stream, None)
        if unit is None:
            break
        if o.max_tokens:
            w = sum(world.lengths[x] for x in unit)
            if tokens + w > o.max_tokens:
                misses += 1
                if out and misses >= TOKEN_LOOKAHEAD:
                    break
                continue
            tokens += w
        misses = 0
        out.extend(unit)
    if not o.max_tokens and len(out) < want:
        out = []
    return out, aside


def kk_model(weights: list[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp with equal part sizes, written plainly (pick the max state by scanning)."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))

    def set_key(s):  # (sum, item count, smallest item)
        return (s[0], len(s[1]), min(s[1]))

    def settle(state):
        return sorted(state, key=set_key, reverse=True)

    def priority(state):  # merged first: largest spread, then largest first set, then smallest item
        return (state[0][0] - state[-1][0], set_key(state[0]), -min(min(s[1]) for s in state))

    states = [settle([(weights[i], [i]) for i in order[s : s + k]]) for s in range(0, len(order), k)]
    while len(states) > 1:
        a = max(states, key=priority)
        states.remove(a)
        b = max(states, key=priority)
        states.remove(b)
        states.append(settle([(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]))
    return [sorted(s[1]) for s in states[0]]


def model_balance(world: World, per_rank: int, n: int, dp_size: int) -> list[list[int]]:
    chosen, _ = model_select(world, per_rank * dp_size, Options(n=n))
    if not chosen:
        return []
    groups = [chosen[g * n : (g + 1) * n] for g in range(len(chosen) // n)]
    weights = [sum(world.lengths.get(x, 1) for x in grp) for grp in groups]
    return [[x for g in part for x in groups[g]] for part in kk_model(weights, dp_size)]


# ------------------------------------------------------------------ building partitions


@st.composite
def worlds(draw, *, uid: bool = False, tags: bool = True):
    counts = draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    total = sum(counts)
    flags = st.lists(st.booleans(), min_size=total, max_size=total)
    produced_y = draw(flags)
    consumed = draw(st.lists(st.integers(0, 9), min_size=total, max_size=total))
    cleared = draw(st.lists(st.integers(0, 19), min_size=total, max_size=total))
    opt_int = lambda lo, hi: st.lists(  # noqa: E731
        st.one_of(st.none(), st.integers(lo, hi)), min_size=total, max_size=total
    )
    lengths = draw(opt_int(1, 60)) if tags else [None] * total
    versions = draw(opt_int(0, 3)) if tags else [None] * total
    uids = draw(opt_int(0, max(1, total // 3))) if uid else [None] * total
    deliveries = draw(st.lists(st.integers(0, 3), min_size=total, max_size=total))
    return {
        "counts": counts,
        "produced_y": produced_y,
        "consumed": [c == 0 for c in consumed],  # ~10 %
        "cleared": [c == 0 for c in cleared],  # ~5 %
        "lengths": lengths,
        "versions": versions,
        "uids": uids,
        "deliveries": deliveries,
    }


def build(client, spec: dict, task: str, need_y: bool) -> World:
    """Create the partition ``p`` described by ``spec``; return the model's view of it."""
    inserts, first = [], 0
    for c in spec["counts"]:
        meta = client.put(TensorDict({"x": torch.arange(c)}, batch_size=[c]), partition_id="p")
        assert meta.global_indexes[0] == first
        inserts.append((first, c))
        first += c
    total = first
    everything = client.get_meta(["x"], 1, "p", mode="force_fetch")
    ys = [i for i in range(total) if spec["produced_y"][i]]
    if ys:
        client.put(TensorDict({"y": torch.ones(len(ys))}, batch_size=[len(ys)]), metadata=everything.select_samples(ys))
    custom = []
    for i in range(total):
        row = {}
        for name, key in (("total_lengths", "lengths"), ("policy_version", "versions"), ("uid", "uids")):
            if spec[key][i] is not None:
                row[name] = spec[key][i] if name != "uid" else f"prompt-{spec[key][i]}"
        custom.append(row)
    if any(custom):
        client.set_custom_meta(BatchMeta.from_columns(list(range(total)), "p", {}, custom_meta=custom))
    consumed = [i for i in range(total) if spec["consumed"][i]]
    for i in consumed:
        client.redis.setbit(f"{client.namespace}:{{{client.namespace}/p}}:cons:{task}", i, 1)
    dlv = {i: d for i, d in enumerate(spec["deliveries"]) if d}
    if dlv:
        client.redis.hset(f"{client.namespace}:{{{client.namespace}/p}}:dlv:{task}", mapping=dlv)
    cleared = [i for i in range(total) if spec["cleared"][i]]
    if cleared:
        client.clear_samples(everything.select_samples(cleared))
    ready = [
        i for i in range(total) if i not in cleared and i not in consumed and (spec["produced_y"][i] or not need_y)
    ]
    live = lambda key: {i: v for i, v in enumerate(spec[key]) if v is not None and i not in cleared}  # noqa: E731
    return World(
        inserts=inserts,
        ready=ready,
        lengths=live("lengths"),
        versions=live("versions"),
        uids={i: f"prompt-{v}" for i, v in live("uids").items()},
        has_uid_tag=any(v is not None for v in spec["uids"]),
        deliveries=dlv,
    )


def poison(client, task: str) -> set[int]:
    return {int(x) for x in client.redis.smembers(f"{client.namespace}:{{{client.namespace}/p}}:poison:{task}")}


# fakeredis runs Lua through lupa and every command in Python: fewer examples there.
# TQ_HYPOTHESIS_SCALE=10 runs ten times as many (a soak run).
EXAMPLES = {"fakeredis": 6, "valkey": 30, "redis7": 20}
SCALE = int(os.environ.get("TQ_HYPOTHESIS_SCALE", "1"))


def on(server):
    """Run the decorated hypothesis property now, against ``server``, with its example budget."""

    def run(prop):
        settings(
            max_examples=EXAMPLES[server.flavour] * SCALE,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )(prop)()

    return run


# ------------------------------------------------------------------ in Redis vs the model


def test_sequential_matches_model(server):
    @on(server)
    @given(
        spec=worlds(),
        need_y=st.booleans(),
        want=st.integers(1, 12),
        budget=st.one_of(st.none(), st.integers(1, 200)),
        version=st.one_of(st.none(), st.integers(0, 3)),
        drop=st.booleans(),
    )
    def check(spec, need_y, want, budget, version, drop):
        client = make_client(server.url, f"s{uuid.uuid4().hex[:8]}")
        try:
            world = build(client, spec, "t", need_y)
            config = {"sampler": "SequentialSampler"}
            o = Options()
            if budget is not None:
                config["max_tokens"] = o.max_tokens = budget
            if version is not None:
                config["min_policy_version"] = o.min_version = version
                config["drop_stale"] = o.drop_stale = drop
            expected, aside = model_select(world, want, o)
            got = client.get_meta(["x", "y"] if need_y else ["x"], want, "p", task_name="t", sampling_config=config)
            assert got.global_indexes == expected
            assert poison(client, "t") == aside
            if budget is not None:
                assert sum(world.lengths[i] for i in expected) <= budget
                assert len(expected) <= want
                fits = [i for i in world.ready if world.lengths.get(i, budget + 1) <= budget]
                if version is None and fits:
                    assert expected, "never empty when one ready sample fits the budget"
        finally:
            client.close()


@st.composite
def wide_worlds(draw):
    """A partition wider than a claim's first window (32 bytes = 256 ids): a consumed prefix, then
    a field `y` produced for a few ids scattered over the rest, so the first ready ids may lie
    many windows past the task's first unconsumed id, or be too few."""
    total = draw(st.integers(300, 3000))
    prefix = draw(st.integers(0, total))
    ys = draw(st.lists(st.integers(0, total - 1), max_size=30, unique=True))
    consumed = draw(st.lists(st.integers(0, total - 1), max_size=30, unique=True))
    return total, set(ys), set(range(prefix)) | set(consumed)


def test_sequential_scan_past_the_first_window_matches_model(server):
    """A claim reads one window at the task's first unconsumed byte and goes on with a stream
    (full alignment) only when that window holds too few ready ids: both paths pick exactly the
    first `want` ready ids, or nothing when fewer are ready."""

    @on(server)
    @given(world=wide_worlds(), want=st.integers(1, 40))
    # ids 500..751 are in the first window; only 582 and 679 of them are ready, so three come after
    @example(world=(2000, set(range(0, 2000, 97)), set(range(500))), want=5)
    def check(world, want):
        total, ys, consumed = world
        client = make_client(server.url, f"w{uuid.uuid4().hex[:8]}")
        try:
            everything = client.put(TensorDict({"x": torch.arange(total)}, batch_size=[total]), partition_id="p")
            if ys:
                produced = everything.select_samples(sorted(ys))
                client.put(TensorDict({"y": torch.ones(len(ys))}, batch_size=[len(ys)]), metadata=produced)
            pipe = client.redis.pipeline(transaction=False)
            for i in consumed:
                pipe.setbit(f"{client.namespace}:{{{client.namespace}/p}}:cons:t", i, 1)
            pipe.execute()
            ready = sorted(ys - consumed)
            expected = ready[:want] if len(ready) >= want else []
            config = {"sampler": "SequentialSampler"}
            got = client.get_meta(["x", "y"], want, "p", task_name="t", sampling_config=config)
            assert got.global_indexes == expected
            # what is left is the rest, in order: the claim marked exactly its batch
            rest = client.get_meta(["x", "y"], 1, "p", task_name="t", sampling_config=config)
            assert rest.global_indexes == [x for x in ready if x not in expected][:1]
        finally:
            client.close()


def test_grpo_matches_model(server):
    @on(server)
    @given(
        spec=st.booleans().flatmap(lambda uid: worlds(uid=uid)),
        n=st.integers(2, 4),
        groups=st.integers(1, 3),
        need_y=st.booleans(),
        budget=st.one_of(st.none(), st.integers(1, 300)),
        version=st.one_of(st.none(), st.integers(0, 3)),
    )
    def check(spec, n, groups, need_y, budget, version):
        client = make_client(server.url, f"g{uuid.uuid4().hex[:8]}")
        try:
            world = build(client, spec, "t", need_y)
            config = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": n}
            o = Options(n=n)
            if budget is not None:
                config["max_tokens"] = o.max_tokens = budget
            if version is not None:
                config["min_policy_version"] = o.min_version = version
            expected, aside = model_select(world, n * groups, o)
            got = client.get_meta(
                ["x", "y"] if need_y else ["x"], n * groups, "p", task_name="t", sampling_config=config
            )
            assert got.global_indexes == expected
            assert poison(client, "t") == aside
            # whole groups only: each unit is one prompt's n rows
            assert len(expected) % n == 0
            for g in range(len(expected) // n):
                unit = expected[g * n : (g + 1) * n]
                if world.has_uid_tag:
                    assert len({world.uids[i] for i in unit}) == 1
                else:
                    first, count = next((f, c) for f, c in world.inserts if f <= unit[0] < f + c)
                    assert unit == list(range(unit[0], unit[0] + n)) and (unit[0] - first) % n == 0
                    assert unit[-1] < first + count
        finally:
            client.close()


def test_max_deliveries_matches_model(server):
    @on(server)
    @given(spec=worlds(tags=False), want=st.integers(1, 6), max_deliveries=st.integers(1, 3))
    def check(spec, want, max_deliveries):
        client = make_client(server.url, f"d{uuid.uuid4().hex[:8]}")
        try:
            world = build(client, spec, "t", need_y=False)
            expected, aside = model_select(world, want, Options(max_deliveries=max_deliveries))
            got = client.get_meta(
                ["x"], want, "p", task_name="t", lease_s=60, sampling_config={"max_deliveries": max_deliveries}
            )
            assert got.global_indexes == expected
            assert poison(client, "t") == aside
            if expected:
                assert got.get_extra_info("delivery_counts") == [world.deliveries.get(i, 0) + 1 for i in expected]
        finally:
            client.close()


def test_rank_aware_matches_model(server):
    """Ranks of a group get the first rank's choice; each new group takes the model's next batch."""

    @on(server)
    @given(spec=worlds(), want=st.integers(1, 5), order=st.permutations([0, 0, 1, 1, 2]))
    def check(spec, want, order):
        client = make_client(server.url, f"r{uuid.uuid4().hex[:8]}")
        try:
            world = build(client, spec, "t", need_y=False)
            chosen: dict[int, list[int]] = {}
            for group in order:
                config = {"sampler": "RankAwareSampler", "dp_rank": group, "batch_index": 7}
                got = client.get_meta(["x"], want, "p", task_name="t", sampling_config=config).global_indexes
                if group not in chosen:
                    expected, _ = model_select(world, want, Options())
                    world.ready = [i for i in world.ready if i not in expected]
                    chosen[group] = expected
                assert got == chosen[group]
        finally:
            client.close()


def test_seqlen_balanced_matches_model(server):
    @on(server)
    @given(spec=worlds(), n=st.integers(1, 3), per_rank_groups=st.integers(1, 2), dp_size=st.integers(1, 3))
    def check(spec, n, per_rank_groups, dp_size):
        client = make_client(server.url, f"b{uuid.uuid4().hex[:8]}")
        try:
            world = build(client, spec, "t", need_y=False)
            per_rank = n * per_rank_groups
            expected = model_balance(world, per_rank, n, dp_size)
            for rank in reversed(range(dp_size)):
                config = {
                    "sampler": "SeqlenBalancedSampler",
                    "n_samples_per_prompt": n,
                    "dp_size": dp_size,
                    "dp_rank": rank,
                    "batch_index": 0,
                }
                got = client.get_meta(["x"], per_rank, "p", task_name="t", sampling_config=config).global_indexes
                assert got == (expected[rank] if expected else [])
        finally:
            client.close()


# ------------------------------------------------------------------ pure Python


@settings(max_examples=200, deadline=None)
@given(
    weights=st.integers(1, 6).flatmap(
        lambda k: st.tuples(st.just(k), st.lists(st.integers(0, 100), min_size=1, max_size=8).map(lambda w: w * k))
    )
)
def test_karmarkar_karp_matches_model(weights):
    k, w = weights
    parts = karmarkar_karp(w, k)
    assert parts == kk_model(w, k)
    assert sorted(i for p in parts for i in p) == list(range(len(w)))
    assert {len(p) for p in parts} == {len(w) // k}
    sums = [sum(w[i] for i in p) for p in parts]
    assert sums == sorted(sums, reverse=True)


def _maximal_runs(ids: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def test_grpo_sample_on_a_bare_list_finds_consecutive_runs_like_the_reference():
    assert GRPOGroupNSampler(3).sample([0, 1, 3, 4, 6, 7], 6) == ([], [])
    assert GRPOGroupNSampler(3).sample([0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6) == ([3, 4, 5, 9, 10, 11],) * 2


@settings(max_examples=100, deadline=None)
@given(ready=st.lists(st.integers(0, 60), unique=True).map(sorted), n=st.integers(1, 4), groups=st.integers(1, 4))
def test_python_sample_matches_model(ready, n, groups):
    """Stand-alone sample(): sequential, GRPO runs, and the balanced model with aligned blocks."""
    world = World(inserts=[(0, 64)], ready=ready)
    assert SequentialSampler().sample(ready, groups) == (ready[:groups], ready[:groups])
    chosen, consumed = GRPOGroupNSampler(n).sample(ready, n * groups)
    assert chosen == consumed
    # Stand-alone, a group is a run of n consecutive ids (the reference's rule): as many groups
    # exist as the maximal runs of consecutive ready ids hold whole windows of n.
    available = sum(len(run) // n for run in _maximal_runs(ready))
    if available < groups:
        assert chosen == []
    else:
        assert len(chosen) == n * groups and chosen == sorted(set(chosen)) and set(chosen) <= set(ready)
        for k in range(groups):
            block = chosen[k * n:(k + 1) * n]
            assert block == list(range(block[0], block[0] + n))
    # Balanced, stand-alone: the GRPO runs for both ranks (as the reference), split by the KK model.
    balanced = SeqlenBalancedSampler(n, dp_size=2)
    lengths = {i: (i * 7) % 11 + 1 for i in ready}
    both, _ = GRPOGroupNSampler(n).sample(ready, n * groups * 2)
    runs = [both[g * n:(g + 1) * n] for g in range(len(both) // n)]
    weights = [sum(lengths[x] for x in run) for run in runs]
    parts = [[x for g in part for x in runs[g]] for part in kk_model(weights, 2)] if both else []
    world.lengths = lengths
    for rank in (1, 0):
        got, _ = balanced.sample(ready, n * groups, "t", "p", dp_rank=rank, batch_index=3, total_lengths=world.lengths)
        assert got == (parts[rank] if parts else [])


def test_rank_aware_python_cache():
    s = RankAwareSampler()
    assert s.sample([1, 2, 3, 4], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p") == ([1, 2], [1, 2])
    assert s.sample([3, 4], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p") == ([1, 2], [1, 2])
    assert s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0})
    assert s.sample([3], 2, dp_rank=1, batch_index=0, task_name="t", partition_id="p") == ([], [])
    s.clear_cache("p")
    assert not s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0})


def test_seqlen_balanced_out_of_range_rank_gets_nothing_and_states_cover_every_rank():
    s = SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
    got = s.sample([0, 1, 2, 3], 2, task_name="t", partition_id="p", dp_rank=0, batch_index=0)
    # as in the reference: a rank past dp_size gets two empty lists (get_meta refuses it instead)
    assert s.sample([0, 1, 2, 3], 2, task_name="t", partition_id="p", dp_rank=5, batch_index=0) == ([], [])
    states = s._states["p"]["t"]
    assert sorted(states) == [0, 1] and states[0][0] == got
    assert sorted(states[0][0][0] + states[1][0][0]) == [0, 1, 2, 3]
    assert s.has_cached_result("p", "t", {"dp_rank": 1, "batch_index": 0})
    with pytest.raises(errors.SamplerError, match="greater than or equal to 0"):
        s.sample([0, 1], 1, task_name="t", partition_id="p", dp_rank=-1, batch_index=0)
    s.clear_cache("p")
    assert "p" not in s._states and not s._balanced_cache


def test_reference_error_wording_with_our_hints():
    for make in (lambda: GRPOGroupNSampler(0), lambda: SeqlenBalancedSampler(1, dp_size=-1)):
        with pytest.raises(errors.SamplerError, match="must be positive, got .*; give a positive integer"):
            make()
    with pytest.raises(errors.SamplerError, match="dp_rank -1 must be greater than or equal to 0; pass"):
        RankAwareSampler().sample([0, 1], 1, dp_rank=-1, batch_index=0, task_name="t", partition_id="p")


def test_get_seqlen_balanced_partitions():
    lengths = [100, 90, 50, 10, 5, 1]
    parts = get_seqlen_balanced_partitions(lengths, k_partitions=2, equal_size=True)
    assert [len(p) for p in parts] == [3, 3] and sorted(sum(parts, [])) == list(range(6))
    assert all(p == sorted(p) for p in parts)
    sums = sorted(sum(lengths[i] for i in p) for p in parts)
    assert sums[1] - sums[0] <= max(lengths)
    # without equal_size only the sums are balanced: the long item stands alone
    parts = get_seqlen_balanced_partitions([100, 10, 10, 10, 10], k_partitions=2, equal_size=False)
    assert sorted(parts) == [[0], [1, 2, 3, 4]]
    assert get_seqlen_balanced_partitions([3, 1, 2], 1, equal_size=False) == [[0, 1, 2]]


@pytest.mark.parametrize(
    "lengths,k,equal,match",
    [([10, 20, 30], 2, True, "cannot be split into 2 parts of equal size"), ([10], 3, False, r"\[1\] < k_partitions")],
)
def test_get_seqlen_balanced_partitions_rejects_impossible_splits(lengths, k, equal, match):
    # an AssertionError as the reference's checks are, and our typed SamplerError (a ValueError)
    for caught in (PartitioningError, AssertionError, errors.SamplerError, ValueError):
        with pytest.raises(caught, match=match):
            get_seqlen_balanced_partitions(lengths, k_partitions=k, equal_size=equal)


def test_dispatch_and_validation():
    class Mine(BaseSampler):
        def sample(self, ready_indexes, batch_size, *args, **kwargs):
            return ready_indexes[:batch_size], ready_indexes[:batch_size]

    class Subclassed(SequentialSampler):
        pass

    assert is_builtin(resolve_sampler("GRPOGroupNSampler"))
    assert is_builtin(resolve_sampler(SeqlenBalancedSampler(2, 4)))
    assert not is_builtin(resolve_sampler(Mine))
    assert not is_builtin(resolve_sampler(Subclassed()))
    with pytest.raises(errors.SamplerError, match="built-in samplers are"):
        resolve_sampler("NoSuchSampler")
    with pytest.raises(errors.SamplerError):
        resolve_sampler(42)
    spec = sampler_spec(GRPOGroupNSampler(4))
    assert spec == {"name": "GRPOGroupNSampler", "params": {"n_samples_per_prompt": 4}}
    import json

    rebuilt = sampler_from_spec(json.dumps(spec))
    assert isinstance(rebuilt, GRPOGroupNSampler) and rebuilt.n_samples_per_prompt == 4
    assert sampler_spec("SequentialSampler") == "SequentialSampler"
    with pytest.raises(errors.SamplerError, match="per call"):
        sampler_from_spec(json.dumps("Mine"))

    grpo = GRPOGroupNSampler(4)
    with pytest.raises(errors.SamplerError, match="multiple of n_samples_per_prompt"):
        builtin_plan(grpo, {}, 6)
    with pytest.raises(ValueError):  # SamplerError is a ValueError, as the reference raises
        grpo.sample([0, 1, 2, 3], 6)
    assert builtin_plan(grpo, {"n_samples_per_prompt": 3}, 6).options == (("n", "3"),)
    with pytest.raises(errors.SamplerError, match="dp_rank"):
        builtin_plan(RankAwareSampler(), {"batch_index": 0}, 2)
    with pytest.raises(errors.SamplerError, match="dp_size"):
        builtin_plan(SeqlenBalancedSampler(1, 2), {"dp_rank": 2}, 2)
    with pytest.raises(errors.SamplerError, match="max_tokens"):
        builtin_plan(SequentialSampler(), {"max_tokens": 0}, 2)
    with pytest.raises(errors.SamplerError, match="min_policy_version"):
        builtin_plan(SequentialSampler(), {"drop_stale": True}, 2)
    with pytest.raises(errors.SamplerError):
        GRPOGroupNSampler(0)


def test_prioritized_sampler_stand_alone_and_as_a_namespace_default():
    sampler = PrioritizedSampler(alpha=2)
    ready = list(range(10))
    heavy = {i: (1e6 if i in (3, 7) else 1e-6) for i in ready}  # weights 1e12 against 1e-12
    assert sampler.sample(ready, 2, priorities=heavy) == ([3, 7], [3, 7])
    assert sampler.sample(ready, 11) == ([], [])  # never a partial batch
    assert len(set(sampler.sample(ready, 10)[0])) == 10
    again = sampler_from_spec(json.dumps(sampler_spec(sampler)))
    assert isinstance(again, PrioritizedSampler) and again.alpha == 2.0 and is_builtin(again)
    plan = builtin_plan(again, {"alpha": 0.5}, 4)
    assert plan.kind == "priority" and dict(plan.options)["alpha"] == "0.5"
    with pytest.raises(errors.SamplerError, match="alpha"):
        PrioritizedSampler(alpha=float("inf"))
    with pytest.raises(errors.SamplerError, match="max_tokens"):
        builtin_plan(again, {"max_tokens": 10}, 4)
