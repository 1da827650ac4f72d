"""One clock decides who holds a leased sample: the server's. Consumers run in processes whose
clocks are shifted by +/-30 s (``time.time`` patched in the child, as a host with a wrong clock
would have it); leases are 25 s, so a client clock that took part would lapse or keep the wrong
leases. Every step's outcome is read from Redis, never timed."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import errors
from tq_redis.meta import BatchMeta
from tq_redis.meta.keys import PartitionKeys
from tq_redis.samplers import BaseSampler

SHIFT_S = 30.0
LEASE_S = 25.0  # shorter than the shift: a shifted client clock would decide the lease's fate
CHILD_TIMEOUT_S = 120


class _Everything(BaseSampler):
    """A user sampler (claims through ready_ids + claim_ids): takes the first ready ids."""

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        return ready_indexes[:batch_size], ready_indexes[:batch_size]


def _shift_clock(shift_s: float) -> None:
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + shift_s
    time.time_ns = lambda: real_time_ns() + int(shift_s * 1e9)


def _consumer(url: str, ns: str, shift_s: float, calls, out) -> None:
    """A consumer whose clock is ``shift_s`` off: runs each ``(action, args)`` from ``calls`` until
    None and puts ``("ok", result)`` or ``("error", type name, message)`` for each."""
    _shift_clock(shift_s)
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns)
    client.get_partition_list()  # connected and checked before the test takes any lease
    out.put(("ready",))
    while (call := calls.get()) is not None:
        action, args = call
        try:
            if action == "claim":
                n, kwargs = args
                result = client.get_meta(["x"], n, "p", task_name="t", **kwargs)
            elif action == "extend":
                result = client.extend_lease(args[0], args[1])
            else:
                result = client.ack(args[0])
            out.put(("ok", result))
        except errors.TQError as exc:
            out.put(("error", type(exc).__name__, str(exc)))
    client.close()


class Shifted:
    """A consumer process whose clock is ``shift_s`` off, started and connected before the test
    takes a lease, so no lease of the test ages while a process starts."""

    def __init__(self, url: str, ns: str, shift_s: float) -> None:
        ctx = mp_context()
        self.calls, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_consumer, args=(url, ns, shift_s, self.calls, self.out))
        self.proc.start()
        assert self.out.get(timeout=CHILD_TIMEOUT_S) == ("ready",)

    def send(self, action: str, *args) -> None:
        self.calls.put((action, args))

    def outcome(self):
        return self.out.get(timeout=CHILD_TIMEOUT_S)

    def __call__(self, action: str, *args):
        self.send(action, *args)
        return self.outcome()

    def close(self) -> None:
        self.calls.put(None)
        self.proc.join(CHILD_TIMEOUT_S)
        assert self.proc.exitcode == 0


@pytest.fixture
def shifted(real_server, namespace):
    """``shifted(shift_s)``: a consumer process of the test's namespace whose clock is that far off."""
    started: list[Shifted] = []

    def start(shift_s: float) -> Shifted:
        started.append(Shifted(real_server.url, namespace, shift_s))
        return started[-1]

    yield start
    for consumer in started:
        consumer.close()


def _put(client, n: int) -> BatchMeta:
    return client.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id="p")


def _server_ms(client) -> int:
    sec, usec = client.redis.time()
    return sec * 1000 + usec // 1000


def _deadlines(client) -> dict[int, float]:
    lease = PartitionKeys(client.namespace, "p").lease("t")
    return {int(i): score for i, score in client.redis.zrange(lease, 0, -1, withscores=True)}


@pytest.mark.parametrize("sampler", [None, _Everything()], ids=["builtin", "user"])
def test_a_consumer_whose_clock_is_ahead_leaves_live_leases_alone(real_server, namespace, shifted, sampler):
    ahead = shifted(SHIFT_S)
    client = make_client(real_server.url, namespace)
    _put(client, 8)
    held = client.get_meta(["x"], 8, "p", task_name="t", lease_s=LEASE_S)
    assert held.size == 8
    kwargs = {"lease_s": LEASE_S, "sampling_config": {"sampler": sampler} if sampler is not None else None}
    status, got = ahead("claim", 8, kwargs)
    assert status == "ok" and got.size == 0, "a clock 30 s ahead took over leases that are live on the server"
    client.ack(held)
    assert client.check_consumption_status("t", "p")
    client.close()


@pytest.mark.parametrize("shift_s", [-SHIFT_S, SHIFT_S], ids=["behind", "ahead"])
def test_a_lease_lasts_its_length_on_the_server_clock_whatever_the_holder_clock(
    real_server, namespace, shifted, shift_s
):
    holder = shifted(shift_s)
    client = make_client(real_server.url, namespace)
    _put(client, 8)
    before = _server_ms(client)
    status, held = holder("claim", 8, {"lease_s": LEASE_S})
    after = _server_ms(client)
    assert status == "ok" and held.size == 8
    for deadline in _deadlines(client).values():
        assert before + LEASE_S * 1000 <= deadline <= after + LEASE_S * 1000
    # nobody else sees them as lapsed
    assert client.get_meta(["x"], 1, "p", task_name="t", lease_s=LEASE_S).size == 0
    client.ack(held)
    client.close()


@pytest.mark.parametrize("shift_s", [-SHIFT_S, SHIFT_S], ids=["behind", "ahead"])
def test_extend_lease_from_a_shifted_clock_extends_on_the_server_clock(real_server, namespace, shifted, shift_s):
    holder = shifted(shift_s)
    client = make_client(real_server.url, namespace)
    _put(client, 4)
    held = client.get_meta(["x"], 4, "p", task_name="t", lease_s=LEASE_S)
    before = _server_ms(client)
    status, result = holder("extend", held, LEASE_S)
    after = _server_ms(client)
    assert status == "ok", result
    for deadline in _deadlines(client).values():
        assert before + LEASE_S * 1000 <= deadline <= after + LEASE_S * 1000
    assert client.get_meta(["x"], 1, "p", task_name="t", lease_s=LEASE_S).size == 0
    client.ack(held)
    client.close()


def test_an_ack_after_the_lease_was_handed_to_another_consumer_does_not_count(real_server, namespace, shifted):
    behind = shifted(-SHIFT_S)
    client = make_client(real_server.url, namespace)
    _put(client, 4)
    first = client.get_meta(["x"], 4, "p", task_name="t", lease_s=0.001)
    # waits (on the server's clock) until the first lease lapses, then takes the samples over
    second = client.get_meta(["x"], 4, "p", task_name="t", lease_s=LEASE_S, timeout=30)
    assert second.global_indexes == first.global_indexes
    assert second.get_extra_info("delivery_counts") == [2, 2, 2, 2]
    # the first holder (its clock behind, as if its lease were still live) acks: it does not count
    got = behind("ack", first)
    assert got[0] == "error" and got[1] == "LeaseLost", got
    assert "[0, 1, 2, 3]" in got[2] and "handed out again" in got[2]
    assert _deadlines(client).keys() == {0, 1, 2, 3}  # still the second holder's
    assert client.ack(second) is None
    assert client.ack(second) is None  # the same holder's ack sent again (a retry) is no error
    with pytest.raises(errors.LeaseLost):
        client.ack(first)
    assert client.check_consumption_status("t", "p")
    assert client.get_meta(["x"], 1, "p", task_name="t", lease_s=LEASE_S, timeout=0.2).size == 0
    client.close()


@pytest.mark.parametrize("shift_s", [-SHIFT_S, SHIFT_S], ids=["behind", "ahead"])
def test_a_leasing_claim_woken_from_a_wait_leases_from_the_server_time_it_ran(
    real_server, namespace, shifted, shift_s
):
    """The claim rides behind the consumer's wait (one round trip): its lease starts when it runs."""
    waiting = shifted(shift_s)
    client = make_client(real_server.url, namespace)
    _put(client, 1)
    assert client.get_meta(["x"], 1, "p", task_name="t", lease_s=LEASE_S).size == 1  # nothing else is ready
    waiting.send("claim", 1, {"lease_s": LEASE_S, "timeout": 60})
    waiters = PartitionKeys(namespace, "p").waiters("t")
    give_up = time.monotonic() + CHILD_TIMEOUT_S
    while client.redis.zcard(waiters) == 0:  # the consumer is registered and blocked on its wake list
        assert time.monotonic() < give_up, "the consumer never started waiting"
        time.sleep(0.01)
    put_at = _server_ms(client)
    _put(client, 1)
    status, got = waiting.outcome()
    assert status == "ok" and got.global_indexes == [1]
    assert _deadlines(client)[1] >= put_at + LEASE_S * 1000
    client.close()


def test_a_waiting_consumer_ahead_in_time_does_not_spin_on_live_leases(real_server, namespace, shifted):
    """The time until the next lease lapses comes from the server: a consumer whose clock is ahead
    would otherwise think the leases lapsed already and claim again and again until its timeout."""
    ahead = shifted(SHIFT_S)
    client = make_client(real_server.url, namespace)
    _put(client, 4)
    held = client.get_meta(["x"], 4, "p", task_name="t", lease_s=LEASE_S)
    calls_before = _fcalls(client)
    status, got = ahead("claim", 1, {"lease_s": LEASE_S, "timeout": 2.0})
    assert status == "ok" and got.size == 0
    assert _fcalls(client) - calls_before < 20
    client.ack(held)
    client.close()


def _fcalls(client) -> int:
    stats = client.redis.info("commandstats")
    return int(stats.get("cmdstat_fcall", {}).get("calls", 0))
