"""Soak: every client streams through a proxy that cuts connections at random (issue 43).

Producers put, a reserver reserves and commits groups, an appender appends parts in two steps,
lease consumers claim and ack, fetch consumers claim, and a reader of the appended field claims
and reads, all through one :class:`tests.faultproxy.FaultProxy` in front of the server, which cuts
connections mid-request and mid-reply (each chunk, either way, with probability ``CUT_P``). Every
call whose reply a cut lost is sent again by redis-py with the same request record and acts once.
Checked: every sample reached each task exactly once (lease mode: delivered and acked once; fetch
mode: nothing lost to a cut, nothing twice), every appended sample read back with exactly its two
parts, and after the final clears no bytes and no state are left (but the keys that expire by
themselves: request records, event streams). Valkey and Redis 7.0.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.faultproxy import FaultProxy
from tests.soak.helpers import leftover_keys

pytestmark = pytest.mark.soak

CUT_P = 0.03
PRODUCERS, PUTS, ROWS = 2, 300, 2  # 1,200 samples put
GROUPS, GROUP = 150, 4  # 600 samples reserved and committed
APPENDS, APPEND_ROWS = 150, 2  # 300 samples with an appended field
BATCH = 4
DEADLINE_S = 100.0  # decides failure only


def _x(values: list[int]) -> TensorDict:
    return TensorDict({"x": torch.tensor(values, dtype=torch.int64).reshape(-1, 1)}, batch_size=[len(values)])


def test_every_sample_once_through_random_cuts(real_server, namespace):
    proxy = FaultProxy.for_url(real_server.url, seed=43)
    url = proxy.url(real_server.url)
    direct = make_client(real_server.url, namespace)
    errors: list[BaseException] = []
    delivered: dict[str, list[int]] = collections.defaultdict(list)
    seen: dict[str, set[int]] = collections.defaultdict(set)
    lock = threading.Lock()
    produced = threading.Event()
    expected = PRODUCERS * PUTS * ROWS + GROUPS * GROUP
    deadline = time.monotonic() + DEADLINE_S

    def running(name: str, body) -> threading.Thread:
        def run() -> None:
            client = make_client(url, namespace)
            try:
                body(client)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
            finally:
                client.close()

        return threading.Thread(target=run, name=name, daemon=True)

    def producer(i: int):
        def body(client) -> None:
            for j in range(PUTS):
                client.put(_x([i * 100_000 + j * 10 + r for r in range(ROWS)]), partition_id="p")
        return body

    def reserver(client) -> None:
        for g in range(GROUPS):
            reservation = client.reserve_group("p", GROUP, lease_s=60)
            client.commit_group(reservation, _x([900_000 + g * 10 + r for r in range(GROUP)]))

    def appender(client) -> None:
        for k in range(APPENDS):
            base = 500_000 + k * 10
            meta = client.put(TensorDict({"prompt": torch.tensor([[base + r] for r in range(APPEND_ROWS)])},
                                         batch_size=[APPEND_ROWS]), partition_id="a")
            first = torch.tensor([[base + r] for r in range(APPEND_ROWS)])
            client.append_parts(meta, {"resp": first}, policy_version=0)
            client.append_parts(meta, {"resp": first + 1}, policy_version=1, complete=True)

    def consumer(task: str, lease: bool):
        def body(client) -> None:
            while len(seen[task]) < expected:
                assert time.monotonic() < deadline, f"{task}: {len(seen[task])} of {expected} samples by the deadline"
                meta = client.get_meta(["x"], BATCH, "p", task_name=task, timeout=0.5,
                                       lease_s=60 if lease else None)
                if meta.size == 0:
                    continue
                values = client.get_data(meta)["x"].reshape(-1).tolist()
                with lock:
                    delivered[task] += values
                    seen[task].update(values)
                if lease:
                    client.ack(meta)
        return body

    def reader(client) -> None:
        task, want = "ap", APPENDS * APPEND_ROWS
        while len(seen[task]) < want:
            assert time.monotonic() < deadline, f"{task}: {len(seen[task])} of {want} appended samples"
            meta = client.get_meta(["prompt", "resp"], APPEND_ROWS, "a", task_name=task, timeout=0.5)
            if meta.size == 0:
                continue
            data = client.get_data(meta)
            for prompt, resp in zip(data["prompt"].reshape(-1).tolist(), data["resp"].unbind()):
                assert resp.reshape(-1).tolist() == [prompt, prompt + 1], f"sample {prompt}: parts {resp.tolist()}"
                with lock:
                    delivered[task].append(prompt)
                    seen[task].add(prompt)

    producers = [running(f"producer{i}", producer(i)) for i in range(PRODUCERS)]
    producers += [running("reserver", reserver), running("appender", appender)]
    consumers = [running(f"{task}{n}", consumer(task, task == "lease"))
                 for task in ("lease", "fetch") for n in range(2)]
    consumers.append(running("reader", reader))
    try:
        proxy.cut_randomly(CUT_P)
        for t in producers + consumers:
            t.start()
        for t in producers:
            t.join(DEADLINE_S)
        produced.set()
        for t in consumers:
            t.join(max(1.0, deadline - time.monotonic() + 5))
        assert not errors, f"a client failed: {errors[0]!r}"
        assert not any(t.is_alive() for t in producers + consumers), "a client did not finish"
        proxy.cut_randomly(0)
        assert proxy.cuts >= 20, f"the proxy cut only {proxy.cuts} times: the soak tested little"

        everything = {i * 100_000 + j * 10 + r for i in range(PRODUCERS) for j in range(PUTS) for r in range(ROWS)}
        everything |= {900_000 + g * 10 + r for g in range(GROUPS) for r in range(GROUP)}
        for task in ("lease", "fetch"):
            counts = collections.Counter(delivered[task])
            twice = sorted(v for v, n in counts.items() if n > 1)
            assert not twice, f"{task}: {len(twice)} samples delivered more than once, e.g. {twice[:5]}"
            assert set(counts) == everything, f"{task}: lost {sorted(everything - set(counts))[:5]}"
        assert sorted(delivered["ap"]) == sorted(500_000 + k * 10 + r for k in range(APPENDS)
                                                 for r in range(APPEND_ROWS))
        assert direct.get_meta(["x"], 1, "p", task_name="lease", lease_s=60).size == 0  # every lease acked
        print(f"\nsoak [{real_server.flavour}]: {proxy.cuts} cuts over {proxy.connections} connections; "
              f"lease {len(delivered['lease'])}, fetch {len(delivered['fetch'])} of {expected} samples, "
              f"appended {len(delivered['ap'])}; 0 duplicated, 0 lost")
    finally:
        proxy.close()
    direct.clear_partition("p")
    direct.clear_partition("a")
    # the reservations' staleness admission hash (published version, admitted count) is kept by
    # clears and drops alike (lua/group_reserve.lua, policy_version.lua): no bytes, no samples
    admission = f"{namespace}:{{{namespace}/p}}:admission"
    left = leftover_keys(real_server.url, namespace, ["p", "a"]) - {admission}
    assert not left, f"left after the final clears: {sorted(left)}"
    assert not list(direct.redis.scan_iter(match=f"{namespace}:*:d:*")), "bytes left after the final clears"
    direct.close()
