"""P13: each call's latency in round trips over a link with a 0.5 ms RTT (a delaying loopback proxy).

Between hosts a round trip costs 100-500 us, not loopback's ~30 us, so the number of *sequential*
round trips a call makes decides the latency users see. Here every connection a client opens goes
through a :class:`~benchmarks.delayproxy.DelayProxy` that holds each byte ``--delay-ms`` (0.25 ms)
each way: one in front of Redis (the client is given the proxy's URL) and one in front of each of
the 4 DRAM storage nodes (each node advertises its proxy's address in the registry, so every client
that discovers it dials the proxy; shared memory is off, so nothing bypasses TCP). The nodes' own
heartbeats go to Redis directly: only the client's traffic is delayed and counted.

Every call runs ``--repeats`` times with the delay on and as many with it off (alternating, so both
come from the same minutes of a machine whose speed drifts); the proxies stay in the path both ways,
so their own cost cancels. The round trip the proxy really adds is measured the same way in the same
run (a Redis ``PING``, delay on against off). A call's latency in RTTs is then

    (median with delay - median without) / (PING with delay - PING without)

the number of sequential round trips on its path. Each proxy also counts *turns* (a request burst
after a reply: one round trip on one connection), so the run reports, per call, how many round trips
went to Redis and to the nodes (total, and the most to any one node), which says what the sequential
count is made of. Each call's minimum (what the design must do) and the reason it is that are in
:data:`CALLS`; the report lists each call above it.

    python -m benchmarks.p13_rtt [--quick] [--repeats 40] [--delay-ms 0.25]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# the client's liveness heartbeat would add a Redis round trip to whichever call it lands in
os.environ.setdefault("TQ_HEARTBEAT_S", "3600")

from benchmarks._common import parse_args, write_result  # noqa: E402
from benchmarks.delayproxy import Counts, DelayProxy, free_port  # noqa: E402

MEASURE = "p13_rtt"
NODES = 4
INLINE_MAX = 4096
SMALL = 16  # int64 per row of an inline field (128 B)
LARGE = 2048  # int64 per row of a stored field (16 KiB, above inline_max_bytes)
SPREAD = 64  # samples of the batch get_data reads from every node


@dataclass(frozen=True)
class Call:
    """One call measured: its name, the minimum sequential round trips the design allows, why."""

    name: str
    minimum: int
    why: str


#: the calls, with the minimum sequential round trips each must make and why (the design's floor)
CALLS: list[Call] = [
    Call("put (inline)", 1, "one function call allocates the ids and writes values and bits"),
    Call("put (store, 1 node)", 2, "bytes to the node, then one function call (ids + bits); the ids "
         "could come from the same script only if the bytes went after it: 3 sequential steps would be "
         "needed if the ids were allocated in a round trip of their own"),
    Call("put (store, 4 nodes)", 2, "bytes to the 4 nodes in parallel, then one function call"),
    Call("get_meta", 1, "one claim script"),
    Call("get_data (inline)", 1, "one read of the values beside the bits"),
    Call("get_data (store, 1 node)", 2, "one read from the node, then the visibility check in Redis "
         "(invariant 4: a sample cleared meanwhile is never returned)"),
    Call("get_data (store, 4 nodes)", 2, "the 4 nodes read in parallel, then the visibility check"),
    Call("get_meta + ack (lease)", 2, "the leased claim, then the ack: one script each"),
    Call("reserve_group", 1, "one script"),
    Call("commit_group (inline)", 1, "one script writes the values and the bits"),
    Call("kv_batch_put (store)", 2, "bytes to the node, then one script (keys -> ids, bits, tags)"),
    Call("kv_batch_get (store)", 3, "keys -> ids (one script), the node read, the visibility check"),
    Call("Channel.put", 1, "one script appends the item"),
    Call("Channel.get", 1, "one script pops the item"),
]


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per case and delay (default 40, quick 8)"
    )
    parser.add_argument("--delay-ms", type=float, default=0.25, help="one-way delay of every proxy (default 0.25)")


class Rig:
    """An embedded Valkey, :data:`NODES` DRAM nodes, a delaying proxy in front of each, a client."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Rig:
        from tq_redis import TransferQueueClient
        from tq_redis.backends.dram.launcher import LocalNodes, spawn_node
        from tq_redis.meta.keys import config_key
        from tq_redis.server.embedded import EmbeddedServer

        stack = self._stack
        server = EmbeddedServer().start()
        stack.callback(server.stop)
        self.direct_url = server.url
        host, _, port = server.url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1].rpartition(":")
        self.redis_proxy = stack.enter_context(DelayProxy((host, int(port)), self.delay_s))
        self.url = self.redis_proxy.url(server.url)
        self.ns = f"p13{uuid.uuid4().hex[:6]}"
        self.node_proxies: list[DelayProxy] = []
        nodes = []
        for _ in range(NODES):
            node_port = free_port()
            proxy = stack.enter_context(DelayProxy(("127.0.0.1", node_port), self.delay_s))
            self.node_proxies.append(proxy)
            nodes.append(spawn_node(self.direct_url, self.ns, listen=f"127.0.0.1:{node_port}", shm=False,
                                    capacity="1GiB", extra_args=("--advertise", proxy.address)))
        stack.callback(LocalNodes(nodes).stop)
        self.client = TransferQueueClient(self.url, self.ns, nested_output=False)
        stack.callback(self.client.close)
        spec = {"backend": "dram", "options": {"shm": False}, "inline_max_bytes": INLINE_MAX}
        self.client.redis.hset(config_key(self.ns), "storage", json.dumps(spec))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def proxies(self) -> list[DelayProxy]:
        return [self.redis_proxy, *self.node_proxies]

    def set_delay(self, delay_s: float) -> None:
        for p in self.proxies:
            p.delay_s = delay_s

    def counts(self) -> list[Counts]:
        return [p.counts() for p in self.proxies]


def turns_between(before: list[Counts], after: list[Counts]) -> dict[str, int]:
    """Round trips between two readings of ``[redis proxy, node proxies...]``: to Redis, to the
    nodes in all, to the busiest node, and how many nodes were reached."""
    diffs = [(a - b).turns for a, b in zip(after, before, strict=True)]
    nodes = diffs[1:]
    return {"redis": diffs[0], "nodes": sum(nodes), "max_node": max(nodes, default=0),
            "nodes_reached": sum(1 for d in nodes if d > 0)}


def rtts(with_delay_s: float, without_s: float, rtt_s: float) -> float:
    """Sequential round trips a call's latency holds: its added latency over the added RTT."""
    return (with_delay_s - without_s) / rtt_s


def _cases(rig: Rig) -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """name -> (prepare, call): ``prepare()`` runs untimed, ``call(prepared)`` is timed."""
    import torch

    from tq_redis.channel.channel import Channel

    c = rig.client
    small = {"x": torch.arange(SMALL, dtype=torch.int64).reshape(1, SMALL)}
    large = {"x": torch.arange(LARGE, dtype=torch.int64).reshape(1, LARGE)}
    spread = {"x": torch.arange(SPREAD * LARGE, dtype=torch.int64).reshape(SPREAD, LARGE)}
    counter = iter(range(1 << 40))

    def spread_put() -> Any:
        return c.put(spread, partition_id="spread")

    def claimable() -> Any:
        c.put(small, partition_id="claim")

    def leased_claim() -> Any:
        c.put(small, partition_id="lease")

    def lease_ack(_: Any) -> Any:
        meta = c.get_meta(["x"], 1, "lease", task_name="t", lease_s=600)
        c.ack(meta)
        return meta

    kv_value = {"x": torch.arange(LARGE, dtype=torch.int64).reshape(1, LARGE)}

    def kv_put_prepare() -> str:
        return f"k{next(counter)}"

    def kv_get_prepare() -> str:
        key = f"g{next(counter)}"
        c.kv_batch_put([key], "kv", fields=kv_value)
        return key

    chan = Channel.create(f"ch{uuid.uuid4().hex[:6]}", redis_url=rig.url, namespace=rig.ns)

    return {
        "put (inline)": (lambda: None, lambda _: c.put(small, partition_id="inline")),
        "put (store, 1 node)": (lambda: None, lambda _: c.put(large, partition_id="store")),
        "put (store, 4 nodes)": (lambda: None, lambda _: c.put(spread, partition_id="spread")),
        "get_meta": (claimable, lambda _: c.get_meta(["x"], 1, "claim", task_name="t")),
        "get_data (inline)": (lambda: c.put(small, partition_id="inline"), c.get_data),
        "get_data (store, 1 node)": (lambda: c.put(large, partition_id="store"), c.get_data),
        "get_data (store, 4 nodes)": (spread_put, c.get_data),
        "get_meta + ack (lease)": (leased_claim, lease_ack),
        "reserve_group": (lambda: None, lambda _: c.reserve_group("groups", 1, lease_s=600)),
        "commit_group (inline)": (lambda: c.reserve_group("groups", 1, lease_s=600),
                                  lambda r: c.commit_group(r, small)),
        "kv_batch_put (store)": (kv_put_prepare, lambda k: c.kv_batch_put([k], "kv", fields=kv_value)),
        "kv_batch_get (store)": (kv_get_prepare, lambda k: c.kv_batch_get([k], "kv")),
        "Channel.put": (lambda: None, lambda _: chan.put({"i": 1})),
        "Channel.get": (lambda: chan.put({"i": 1}), lambda _: chan.get()),
    }


def _time_call(rig: Rig, prepare: Callable[[], Any], call: Callable[[Any], Any]) -> tuple[float, dict[str, int]]:
    prepared = prepare()
    before = rig.counts()
    t0 = time.perf_counter()
    call(prepared)
    elapsed = time.perf_counter() - t0
    return elapsed, turns_between(before, rig.counts())


def measure_ping(rig: Rig, repeats: int) -> dict[str, float]:
    """The Redis PING's median with the delay on and off, and the RTT the proxy adds."""
    on, off = [], []
    r = rig.client.redis
    for _ in range(repeats):
        for delay, out in ((rig.delay_s, on), (0.0, off)):
            rig.set_delay(delay)
            t0 = time.perf_counter()
            r.ping()
            out.append(time.perf_counter() - t0)
    rig.set_delay(rig.delay_s)
    ping_on, ping_off = statistics.median(on), statistics.median(off)
    return {"ping_delay_ms": ping_on * 1e3, "ping_plain_ms": ping_off * 1e3,
            "rtt_added_ms": (ping_on - ping_off) * 1e3, "rtt_asked_ms": 2 * rig.delay_s * 1e3}


def measure(repeats: int, delay_s: float) -> dict[str, Any]:
    """Every call of :data:`CALLS` through the proxies; one entry per call."""
    with Rig(delay_s) as rig:
        cases = _cases(rig)
        for prepare, call in cases.values():  # warm-up: connections, the library, the ring, codecs
            for _ in range(3):
                call(prepare())
        ping = measure_ping(rig, max(100, 4 * repeats))
        rtt_s = ping["rtt_added_ms"] / 1e3
        print(f"PING: {ping['ping_delay_ms']:.3f} ms with the delay, {ping['ping_plain_ms']:.3f} ms without: "
              f"the proxy adds {ping['rtt_added_ms']:.3f} ms a round trip (asked {ping['rtt_asked_ms']:.3f})")
        rows: dict[str, Any] = {}
        for spec in CALLS:
            prepare, call = cases[spec.name]
            on, off, turns = [], [], []
            for _ in range(repeats):
                for delay, out in ((delay_s, on), (0.0, off)):
                    rig.set_delay(delay)
                    elapsed, t = _time_call(rig, prepare, call)
                    out.append(elapsed)
                    turns.append(t)
            rig.set_delay(delay_s)
            med_on, med_off = statistics.median(on), statistics.median(off)
            seq = rtts(med_on, med_off, rtt_s)
            typical = {k: statistics.median(t[k] for t in turns) for k in turns[0]}
            rows[spec.name] = {
                "delay_ms": med_on * 1e3, "plain_ms": med_off * 1e3, "rtts": seq,
                "turns_median": typical, "turns_max": {k: max(t[k] for t in turns) for k in turns[0]},
                "minimum": spec.minimum, "above_minimum": round(seq - spec.minimum, 2), "why_minimum": spec.why,
            }
            print(f"  {spec.name:28s} {med_on * 1e3:7.2f} ms ({med_off * 1e3:6.2f} without delay) "
                  f"= {seq:4.1f} RTT (min {spec.minimum}); round trips: redis {typical['redis']:g}, "
                  f"nodes {typical['nodes']:g} (max/node {typical['max_node']:g}, "
                  f"{typical['nodes_reached']:g} reached)",
                  flush=True)
        return {"ping": ping, "calls": rows}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _add_args)
    repeats = args.repeats or (8 if args.quick else 40)
    results = {"tq_redis": measure(repeats, args.delay_ms / 1e3)}
    write_result(MEASURE, args, {"repeats": repeats, "delay_ms": args.delay_ms, "nodes": NODES}, results, args.out)


if __name__ == "__main__":
    main()
