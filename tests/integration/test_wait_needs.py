"""New data wakes a waiting consumer only once its batch can be claimed (``lua/includes/waiters.lua``).

A waiter registered by a built-in sampler's claim states its need (batch size and fields); an
``insert`` or ``produced`` event pushes a wake token for the task only when that many samples are
ready. Anything else -- waiters of one task that ask for different things, a user sampler, a token
budget, leases in flight, an event that is not new data -- wakes one waiter per event as before.

The waiters here are registered by the ``claim`` script itself with no client blocked behind them,
so a wake token that an event pushes stays in the task's wake list where the test can count it.
Every test runs on fakeredis, Valkey 9 and Redis 7.0 (the ``client`` fixture).
"""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.test_waiting import _blocked, _wait_until
from tq_redis.meta.keys import PartitionKeys
from tq_redis.ops import transitions
from tq_redis.ops.claim_plan import SamplerPlan

WAIT_MS = 30_000


def _claim(client, partition: str, task: str, batch: int, fields: list[str], waiter: str,
           sampler: str = "sequential", options: dict | None = None):  # fmt: skip
    """One claim of ``task`` by waiter ``waiter``, as a waiting consumer sends it (its reply)."""
    plan = SamplerPlan(sampler, batch, tuple((name, str(value)) for name, value in (options or {}).items()))
    claim = transitions.claim(client.context.keys(partition), task, plan, fields, waiter=waiter, wait_ms=WAIT_MS)
    return client.run(claim.call())


def _register(client, partition: str, task: str, batch: int, fields: list[str], waiter: str, **plan) -> None:
    """Run the claim a consumer of ``task`` runs before it waits: it finds too little and registers."""
    got = _claim(client, partition, task, batch, fields, waiter, **plan)
    assert got.ids == [] and got.registered, "the claim should have found too little and registered the waiter"


def _tokens(client, partition: str, task: str) -> int:
    return client.redis.llen(PartitionKeys(client.namespace, partition).wake(task))


def _put(client, partition: str, n: int) -> None:
    """Insert ``n`` samples with field ``x`` (an ``insert`` event)."""
    client.put(TensorDict({"x": torch.arange(n)}, batch_size=[n]), partition_id=partition)


def test_puts_too_small_for_the_waiting_batch_wake_no_one(client):
    client.put(TensorDict({"x": torch.arange(1)}, batch_size=[1]), partition_id="p")
    _register(client, "p", "train", 8, ["x"], "w1")
    for _ in range(6):  # 1 + 6 = 7 ready: a claim of 8 would find too little
        _put(client, "p", 1)
        assert _tokens(client, "p", "train") == 0
    _put(client, "p", 1)  # the 8th
    assert _tokens(client, "p", "train") == 1
    assert client.get_meta(["x"], 8, "p", task_name="train").global_indexes == list(range(8))


def test_a_need_counts_only_samples_with_every_field_it_asks_for(client):
    _put(client, "p", 4)
    _register(client, "p", "train", 4, ["x", "y"], "w1")
    _put(client, "p", 4)  # more samples without y: still none has both fields
    assert _tokens(client, "p", "train") == 0
    meta = client.get_meta(["x"], 4, "p", task_name="producer")
    client.put(TensorDict({"y": torch.arange(4)}, batch_size=[4]), metadata=meta)  # a produced event
    assert _tokens(client, "p", "train") == 1


def test_a_need_counts_only_samples_the_task_has_not_consumed(client):
    _put(client, "p", 4)
    assert client.get_meta(["x"], 4, "p", task_name="train").size == 4
    _register(client, "p", "train", 4, ["x"], "w1")
    _put(client, "p", 3)  # 3 new ready; the 4 consumed ones do not count
    assert _tokens(client, "p", "train") == 0
    _put(client, "p", 1)
    assert _tokens(client, "p", "train") == 1


def test_waiters_of_one_task_asking_for_different_batches_are_woken_by_every_event(client):
    _register(client, "p", "train", 8, ["x"], "w1")
    _register(client, "p", "train", 2, ["x"], "w2")  # another need for the same task: not known
    _put(client, "p", 1)
    assert _tokens(client, "p", "train") == 1  # as before needs: one waiter per event
    pk = PartitionKeys(client.namespace, "p")
    assert client.redis.get(pk.waitneed("train")) == b"*"


def test_waiters_asking_for_the_same_batch_keep_their_need(client):
    _register(client, "p", "train", 4, ["x"], "w1")
    _register(client, "p", "train", 4, ["x"], "w2")  # DP ranks: the same request
    _put(client, "p", 3)
    assert _tokens(client, "p", "train") == 0
    _put(client, "p", 1)
    assert _tokens(client, "p", "train") == 1


def test_a_task_whose_waiters_all_left_takes_the_next_waiters_need(client):
    _register(client, "p", "train", 8, ["x"], "w1")
    _register(client, "p", "train", 2, ["x"], "w2")  # mixed: '*'
    client.redis.delete(PartitionKeys(client.namespace, "p").waiters("train"))  # both gave up
    _register(client, "p", "train", 4, ["x"], "w3")
    _put(client, "p", 3)
    assert _tokens(client, "p", "train") == 0


def test_token_budgets_and_rank_choices_wake_on_every_event(client):
    """A claim with a token budget may hand out fewer samples than asked, and a rank's claim the
    samples an earlier rank chose: neither records a need."""
    _register(client, "p", "budget", 8, ["x"], "w1", options={"max_tokens": 100})
    _register(client, "p", "rank", 8, ["x"], "w2", sampler="rank", options={"dp_rank": 0, "batch_index": 0})
    _put(client, "p", 1)
    assert _tokens(client, "p", "budget") == 1
    assert _tokens(client, "p", "rank") == 1


def test_a_user_samplers_wait_records_no_need(client):
    pk = client.context.keys("p")
    _put(client, "p", 1)
    last = client.redis.xrevrange(pk.events, count=1)[0][0].decode()
    assert client.run(transitions.wait(pk, "user", "w1", WAIT_MS, last).call())
    assert client.redis.get(pk.waitneed("user")) == b"*"
    _put(client, "p", 1)
    assert _tokens(client, "p", "user") == 1


def test_leases_in_flight_make_every_event_wake_a_waiter(client):
    """A lapsed lease hands its samples back inside the next claim, which the ready count cannot
    see: while a task has leases in flight, new data wakes its waiters whatever their need."""
    _put(client, "p", 2)
    assert client.get_meta(["x"], 2, "p", task_name="train", lease_s=60).size == 2
    _register(client, "p", "train", 4, ["x"], "w1")
    _put(client, "p", 1)
    assert _tokens(client, "p", "train") == 1


def test_a_lease_taken_after_the_waiter_registered_makes_new_data_wake_it(client):
    """The waiter registered its need with no lease in flight; another consumer then leases
    samples (and may die): new data wakes the waiter, whose claim would hand back a lapsed lease."""
    _put(client, "p", 2)
    _register(client, "p", "train", 4, ["x"], "w1")
    assert client.get_meta(["x"], 2, "p", task_name="train", lease_s=60).size == 2
    _put(client, "p", 1)
    assert _tokens(client, "p", "train") == 1


def test_events_that_are_not_new_data_wake_regardless_of_the_need(client):
    _put(client, "p", 2)
    _register(client, "p", "train", 8, ["x"], "w1")
    client.seal_partition("p")  # a streaming reader ends on it
    assert _tokens(client, "p", "train") == 1


def test_the_baton_goes_on_only_when_the_next_waiter_can_be_served(client):
    """After a claim hands samples out, another waiter is woken only if the rest fills its batch."""
    _register(client, "p", "train", 4, ["x"], "w1")
    _register(client, "p", "train", 4, ["x"], "w2")
    _put(client, "p", 6)  # one batch of 4 now, 2 left over
    assert _tokens(client, "p", "train") == 1
    client.redis.delete(PartitionKeys(client.namespace, "p").wake("train"))  # w1 took the token
    assert _claim(client, "p", "train", 4, ["x"], "w1").ids == [0, 1, 2, 3]
    assert _tokens(client, "p", "train") == 0  # 2 left: not enough for w2
    _put(client, "p", 2)
    assert _tokens(client, "p", "train") == 1


def test_clearing_the_partition_removes_the_need(client):
    _put(client, "p", 1)
    _register(client, "p", "train", 8, ["x"], "w1")
    pk = PartitionKeys(client.namespace, "p")
    assert client.redis.exists(pk.waitneed("train"))
    client.clear_partition("p")
    assert not client.redis.exists(pk.waitneed("train"))


def test_a_blocked_consumer_sleeps_through_small_puts_and_gets_its_batch(real_server, namespace):
    """End to end on a real server: a consumer blocked for a batch of 8 sends no claim while seven
    single-sample puts land, and gets the batch when the eighth does."""
    producer, consumer = make_client(real_server.url, namespace), make_client(real_server.url, namespace)
    consumer.get_partition_list()  # a client's first call learns the namespace's epoch (server.identity) first
    sent: list[list[str]] = []
    real_pipeline = consumer.redis.pipeline_on_lane

    def recording(commands):
        sent.append([str(c[0]) for c in commands])
        return real_pipeline(commands)

    consumer.redis.pipeline_on_lane = recording
    got: dict = {}
    thread = threading.Thread(target=lambda: got.setdefault("meta", consumer.get_meta(["x"], 8, "p", task_name="t",
                                                                                      timeout=30)))  # fmt: skip
    try:
        thread.start()
        assert _wait_until(lambda: _blocked(producer) == 1, 10), "the consumer never waited"
        for k in range(7):
            producer.put(TensorDict({"x": torch.tensor([k])}, batch_size=[1]), partition_id="p")
        # each put's script pushed no token (the wake list is empty and the consumer still blocks)
        assert _tokens(producer, "p", "t") == 0 and _blocked(producer) == 1
        producer.put(TensorDict({"x": torch.tensor([7])}, batch_size=[1]), partition_id="p")
        thread.join(30)
        assert got["meta"].global_indexes == list(range(8))
        assert len(sent) == 1, f"the consumer was woken {len(sent) - 1} time(s) before its batch was ready"
    finally:
        producer.close()
        consumer.close()
