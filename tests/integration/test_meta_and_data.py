"""``get_meta_and_data``: a claim that brings its batch's data, one round trip for small values.

Round trips are counted on real servers (as in ``test_inline.py``); behaviour runs on fakeredis
too. The multi-process test checks invariant 1 with consumers mixing the combined call and the
two-call path on one task, with values both inline and in the store.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.test_inline import LIMIT, _calls, _td
from tests.procs import drain, mp_context
from tq_redis import AsyncTransferQueueClient, ops, samplers
from tq_redis.errors import InvalidArgument, LibraryNotLoaded
from tq_redis.ops.transitions import _read_claim


def _big(n: int, start: int = 0) -> TensorDict:
    """Rows too large to be kept inline (2048 float32 = 8 KiB a value), row i filled with start + i."""
    x = (torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)).expand(n, 2048).contiguous()
    return TensorDict({"x": x}, batch_size=[n])


def test_small_values_come_with_the_claim_in_one_round_trip(counted):
    counted.put(_td(4), partition_id="p")
    (meta, data), calls = _calls(counted, ops.get_meta_and_data(counted.context, ["x", "y"], 3, "p", task_name="t"))
    assert calls == ["claim"], calls  # no read_inline: the claim returned the values
    assert list(meta.global_indexes) == [0, 1, 2]
    assert meta.get_extra_info("task_name") == "t"
    assert torch.equal(data["x"], _td(4)["x"][:3]) and torch.equal(data["y"], _td(4)["y"][:3])
    meta, data = counted.get_meta_and_data(["x", "y"], 3, "p", task_name="t")
    assert meta.size == 0 and data.batch_size == torch.Size([0])  # never a partial batch; 1 left


def test_values_in_the_store_are_read_and_checked_after_the_claim(counted):
    counted.put(_big(2, start=7), partition_id="p")
    (meta, data), calls = _calls(counted, ops.get_meta_and_data(counted.context, ["x"], 2, "p", task_name="t"))
    assert calls == ["claim", "store", "check_visible"], calls  # bytes, then the bits
    assert torch.equal(data["x"], _big(2, start=7)["x"])


def test_inline_and_store_values_of_one_batch_come_back_in_claim_order(inline_client):
    inline_client.put(TensorDict({"x": torch.full((2, 2048), 1.0)}, batch_size=[2]), partition_id="p")
    small = inline_client.put(TensorDict({"x": torch.full((2, 2048), 2.0)}, batch_size=[2]), partition_id="p")
    inline_client.put(TensorDict({"x": torch.full((2, 4), 3.0)}, batch_size=[2]), metadata=small)  # now inline
    meta, data = inline_client.get_meta_and_data(["x"], 4, "p", task_name="t")
    assert list(meta.global_indexes) == [0, 1, 2, 3]
    assert [float(data["x"][i][0]) for i in range(4)] == [1.0, 1.0, 3.0, 3.0]
    assert [data["x"][i].shape[0] for i in range(4)] == [2048, 2048, 4, 4]


def test_the_same_batch_as_get_meta_then_get_data(server, namespace):
    """Same samples, same data, same metadata as the two-call path on a twin partition."""
    client = make_client(server.url, namespace, inline_max_bytes=LIMIT, nested_output=True)
    try:
        jagged = torch.nested.as_nested_tensor([torch.arange(k + 1) for k in range(6)], layout=torch.jagged)
        for pid in ("a", "b"):
            client.put(TensorDict({"p": jagged, "u": torch.arange(6).unsqueeze(1)}, batch_size=[6]), partition_id=pid)
        two = client.get_meta(["p", "u"], 4, "a", task_name="t")
        two_data = client.get_data(two)
        one, one_data = client.get_meta_and_data(["p", "u"], 4, "b", task_name="t")
        assert list(one.global_indexes) == list(two.global_indexes)
        assert one.field_names == two.field_names
        for name in ("p", "u"):
            assert one_data[name].is_nested and two_data[name].is_nested  # the reference's layout
            assert [r.tolist() for r in one_data[name].unbind()] == [r.tolist() for r in two_data[name].unbind()]
    finally:
        client.close()


def test_a_lease_from_the_combined_call_is_acknowledged_like_any_other(inline_client):
    inline_client.put(_td(2), partition_id="p")
    meta, data = inline_client.get_meta_and_data(["x"], 2, "p", task_name="t", lease_s=30)
    assert data["x"].shape == (2, 4)
    inline_client.ack(meta)
    assert inline_client.get_meta_and_data(["x"], 1, "p", task_name="t")[0].size == 0


class _Reversed(samplers.BaseSampler):
    """A user sampler (claimed through ``claim_ids``, which brings no values): the last ready ids."""

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        chosen = list(ready_indexes)[-batch_size:]
        return chosen, chosen


def test_a_user_samplers_batch_is_read_the_two_call_way(inline_client):
    inline_client.put(_td(5), partition_id="p")
    meta, data = inline_client.get_meta_and_data(["x"], 2, "p", task_name="t", sampling_config={"sampler": _Reversed()})
    assert sorted(meta.global_indexes) == [3, 4]
    assert torch.equal(data["x"], _td(5)["x"][list(meta.global_indexes)])


def test_waits_for_a_batch_within_its_timeout(inline_client):
    meta, data = inline_client.get_meta_and_data(["x"], 2, "p", task_name="t", timeout=0.05)
    assert meta.size == 0 and data.batch_size == torch.Size([0])
    inline_client.put(_td(2), partition_id="p")
    meta, data = inline_client.get_meta_and_data(["x"], 2, "p", task_name="t", timeout=5)
    assert torch.equal(data["x"], _td(2)["x"])


def test_a_cleared_partition_hands_out_nothing(inline_client):
    inline_client.put(_td(2), partition_id="p")
    inline_client.clear_partition("p")
    meta, data = inline_client.get_meta_and_data(["x"], 1, "p", task_name="t")
    assert meta.size == 0 and len(data.keys()) == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.get_meta_and_data([], 1, "p", task_name="t"), "at least one field"),
        (lambda c: c.get_meta_and_data(["x"], 1, "p"), "task_name"),
        (lambda c: c.get_meta_and_data(["x"], 0, "p", task_name="t"), "batch_size"),
        (lambda c: c.get_meta_and_data(["x"], 1, "p", task_name="t", timeout=-1), "timeout"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_fix(inline_client, call, message):
    with pytest.raises(InvalidArgument, match=message):
        call(inline_client)


def test_task_name_is_keyword_only(inline_client):
    with pytest.raises(TypeError, match="positional"):
        inline_client.get_meta_and_data(["x"], 1, "p", "t")


def test_the_async_twin(server, namespace):
    make_client(server.url, namespace, inline_max_bytes=LIMIT).close()

    async def main():
        client = AsyncTransferQueueClient(server.url, namespace, nested_output=False)
        try:
            await client.async_put(_td(3), partition_id="p")
            return await client.async_get_meta_and_data(["x", "y"], 3, "p", task_name="t")
        finally:
            await client.async_close()

    meta, data = asyncio.run(main())
    assert list(meta.global_indexes) == [0, 1, 2] and torch.equal(data["y"], _td(3)["y"])


def test_a_reply_with_the_wrong_number_of_values_names_the_library_mismatch():
    reply = ["", [0, 1], [], [], [], -1, 0, 1, [b"v"]]  # two ids x one field, but one value
    with pytest.raises(LibraryNotLoaded, match="load-library"):
        _read_claim(reply, ["x"])


# ------------------------------------------------------------------ across processes

PRODUCERS, BATCHES, BATCH = 4, 6, 8
TOTAL = PRODUCERS * BATCHES * BATCH


def _rows(origin: torch.Tensor, big: bool) -> torch.Tensor:
    width = 2048 if big else 4  # big rows live in the store, small ones inline
    return origin.unsqueeze(1).float() * 10 + torch.arange(width)


def _producer(url: str, ns: str, rank: int, go) -> None:
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)
    go.wait()
    for b in range(BATCHES):
        origin = torch.arange(BATCH) + (rank * BATCHES + b) * BATCH
        rows = _rows(origin, big=(b % 2 == 1))
        client.put(TensorDict({"origin": origin, "rows": rows}, batch_size=[BATCH]), partition_id="train")
    client.close()


def _consumer(url: str, ns: str, combined: bool, go, producers_done, out, first_claims) -> None:
    """Claims until the task is done. So that both paths surely take part whoever the scheduler
    favours, the plain consumer starts once a combined one has claimed, and each combined one goes on
    after its first claim once the plain one has claimed (``first_claims``: (combined, plain) events)."""
    from tq_redis import TransferQueueClient

    client = TransferQueueClient(url, ns, nested_output=False)
    go.wait()
    mine, other = first_claims if combined else first_claims[::-1]
    if not combined:
        other.wait(60)
    seen: list[int] = []
    bad = 0
    claimed = False
    while True:
        if combined:
            meta, data = client.get_meta_and_data(["origin", "rows"], 4, "train", task_name="t", timeout=0.5)
        else:
            meta = client.get_meta(["origin", "rows"], 4, "train", task_name="t", timeout=0.5)
            data = client.get_data(meta) if meta.size else None
        if meta.size:
            for i, sample in enumerate(meta.global_indexes):
                origin = int(data["origin"][i])
                row = data["rows"][i]
                bad += int(not torch.equal(row, _rows(torch.tensor([origin]), big=len(row) == 2048)[0]))
                seen.append(int(sample))
            if not claimed:
                claimed = True
                mine.set()
                if combined:
                    other.wait(60)
        elif producers_done.is_set() and client.check_consumption_status("t", "train"):
            break
    out.put((combined, seen, bad))
    client.close()


def test_consumers_mixing_both_paths_share_a_task_without_duplicates_or_losses(real_server, namespace):
    make_client(real_server.url, namespace, inline_max_bytes=LIMIT).close()  # inline values on
    ctx = mp_context()
    go, producers_done, out, first_claims = ctx.Event(), ctx.Event(), ctx.Queue(), (ctx.Event(), ctx.Event())
    producers = [ctx.Process(target=_producer, args=(real_server.url, namespace, r, go)) for r in range(PRODUCERS)]
    consumers = [
        ctx.Process(target=_consumer, args=(real_server.url, namespace, combined, go, producers_done, out,
                                            first_claims))  # fmt: skip
        for combined in (True, True, True, False)
    ]
    results = drain(producers, consumers, go, producers_done, out)
    counts = Counter(i for _, seen, _ in results for i in seen)
    assert [i for i, c in counts.items() if c > 1] == [], "samples handed out twice"
    assert sorted(counts) == list(range(TOTAL)), "samples lost"
    assert sum(bad for _, _, bad in results) == 0, "a row did not match its sample"
    assert any(seen for combined, seen, _ in results if combined), "the combined path claimed nothing"
    assert any(seen for combined, seen, _ in results if not combined), "the plain path claimed nothing"


# ------------------------------------------------------------------ the streaming loader


def test_the_streaming_loader_reads_small_batches_with_their_claim(real_server, namespace, monkeypatch):
    """StreamingDataset takes the values that came with each claim: no read_inline call for
    inline batches, and a store-backed batch is still read (and checked) from the store."""
    import tq_redis as tq
    from tq_redis.ops import transitions

    client = make_client(real_server.url, namespace, inline_max_bytes=LIMIT)
    client.put(_td(4), partition_id="p")
    client.put(TensorDict({"x": torch.ones(2, 2048), "y": torch.ones(2, 2048)}, batch_size=[2]), partition_id="p")
    client.seal_partition("p")
    reads = []
    real_read_inline = transitions.read_inline
    monkeypatch.setattr(transitions, "read_inline", lambda *a, **k: reads.append(a) or real_read_inline(*a, **k))
    conf = {"redis": {"url": real_server.url}, "namespace": namespace, "compat": {"nested_output": False}}
    ds = tq.StreamingDataset(conf, 4, 4, ["x", "y"], "p", "train", dp_rank=0)
    try:
        batches = [(td, meta) for td, meta in ds]
    finally:
        ds.close()
        client.close()
    assert [list(meta.global_indexes) for _, meta in batches] == [[0, 1, 2, 3], [4, 5]]
    assert torch.equal(batches[0][0]["x"], _td(4)["x"])
    assert torch.equal(batches[1][0]["y"], torch.ones(2, 2048))
    assert reads == []
