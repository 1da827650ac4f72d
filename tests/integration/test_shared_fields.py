"""Group-shared fields (``put_shared``, docs/async-rl.rst): one value put for a whole group is
stored once, every member's ``get_data`` returns it, and it is freed exactly once, when the last
member is cleared, on every server flavour, for inline and store values, with real storage nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.errors import BatchSizeMismatch, DataNotReady, InvalidArgument
from tq_redis.meta import BatchMeta

DEADLINE_S = 600  # generous: child processes import torch on a loaded machine; nothing waits on it unless it must
IMAGE = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(1, 2, 3, 8)  # one group's image: 192 bytes


@pytest.fixture(params=["store", "inline"])
def sclient(request, server, namespace):
    c = make_client(server.url, namespace, inline_max_bytes=4096 if request.param == "inline" else 0)
    c.where = request.param
    yield c
    c.close()


def _group(client, n: int, pid: str = "p"):
    return client.put(TensorDict({"resp": torch.arange(n * 2).reshape(n, 2)}, batch_size=[n]), partition_id=pid)


def _copies(client, field: str, pid: str = "p") -> int:
    """How many values of ``field`` the partition holds: store keys (the ``redis`` store keeps them
    in the same server) plus inline entries."""
    pk = client.context.keys(pid)
    stored = sum(1 for k in client.redis.scan_iter(match=f"{pk.prefix}d:*:{field}", count=1000))
    inline = sum(1 for k in client.redis.hkeys(pk.prefix + "inline") if k.endswith(f":{field}".encode()))
    return stored + inline


def _share_keys(client, pid: str = "p") -> list[bytes]:
    pk = client.context.keys(pid)
    return [k for k in client.redis.scan_iter(match=f"{pk.prefix}*", count=1000)
            if any(k.endswith(s) for s in (b":shared", b":carriers", b":sharepending")) or b":share:" in k]


def test_a_shared_field_is_stored_once_and_every_member_reads_it(sclient):
    meta = _group(sclient, 4)
    out = sclient.put_shared(TensorDict({"image": IMAGE}, batch_size=[1]), meta)
    assert set(out.field_names) == {"resp", "image"} and list(out.global_indexes) == list(meta.global_indexes)
    assert _copies(sclient, "image") == 1
    data = sclient.get_data(out)
    assert data.batch_size == torch.Size([4]) and torch.equal(data["image"], IMAGE.expand(4, 2, 3, 8))
    assert torch.equal(data["resp"], torch.arange(8).reshape(4, 2))
    assert torch.equal(sclient.get_data(out[2:3])["image"], IMAGE)  # one member alone
    # consumers find the members ready for the shared field, and read it with the claim too
    claimed = sclient.get_meta(["image", "resp"], 2, "p", task_name="train")
    assert claimed.size == 2 and torch.equal(sclient.get_data(claimed)["image"], IMAGE.expand(2, 2, 3, 8))
    claimed, got = sclient.get_meta_and_data(["image", "resp"], 2, "p", task_name="train")
    assert claimed.size == 2 and torch.equal(got["image"], IMAGE.expand(2, 2, 3, 8))
    # the reference's output layout (nested tensors) has the same batch shape
    nested = make_client(sclient.redis_url, sclient.context.namespace, nested_output=True)
    try:
        td = nested.get_data(out)
        assert td.batch_size == torch.Size([4]) and [tuple(t.shape) for t in td["image"].unbind(0)] == [(2, 3, 8)] * 4
    finally:
        nested.close()


def test_clearing_all_members_but_one_keeps_the_value_and_the_last_frees_it(sclient):
    meta = _group(sclient, 4)
    other = _group(sclient, 2)
    meta = sclient.put_shared({"image": IMAGE}, meta)
    other = sclient.put_shared({"image": IMAGE + 1}, other)
    assert _copies(sclient, "image") == 2
    sclient.clear_samples(meta[0:3])
    assert _copies(sclient, "image") == 2
    assert torch.equal(sclient.get_data(meta[3:4].select_fields(["image"]))["image"], IMAGE)
    sclient.clear_samples(meta[0:4])  # the last member (and the cleared ones again: idempotent)
    assert _copies(sclient, "image") == 1
    assert torch.equal(sclient.get_data(other.select_fields(["image"]))["image"], (IMAGE + 1).expand(2, 2, 3, 8))
    sclient.clear_samples(other)
    assert _copies(sclient, "image") == 0 and _share_keys(sclient) == []


def test_rewriting_a_members_shared_field_gives_it_its_own_value(sclient):
    meta = sclient.put_shared({"image": IMAGE}, _group(sclient, 3))
    sclient.put({"image": torch.zeros(1, 2, 3, 8)}, metadata=meta[0:1].select_fields([]))
    data = sclient.get_data(meta.select_fields(["image"]))["image"]
    assert torch.equal(data[0], torch.zeros(2, 3, 8)) and torch.equal(data[1:], IMAGE.expand(2, 2, 3, 8))
    sclient.put({"image": torch.ones(2, 2, 3, 8)}, metadata=meta[1:3].select_fields([]))
    assert _copies(sclient, "image") == 3  # the members' own values; the shared one is freed
    assert _share_keys(sclient) == []
    sclient.clear_partition("p")
    assert _copies(sclient, "image") == 0


def test_bad_shared_puts_are_refused_and_leave_nothing(client):
    meta = _group(client, 4)
    with pytest.raises(BatchSizeMismatch, match="one row"):
        client.put_shared({"image": IMAGE.expand(2, 2, 3, 8)}, meta)
    shared = client.put_shared({"image": IMAGE}, meta[0:2])
    with pytest.raises(InvalidArgument, match="produced already"):
        client.put_shared({"image": IMAGE}, meta[1:4])
    with pytest.raises(InvalidArgument, match="one partition"):
        client.put_shared({"image": IMAGE}, BatchMeta.concat([meta[2:3], _group(client, 1, "q")]))
    assert _copies(client, "image") == 1  # the first put only: the refused ones left no bytes
    wanted = BatchMeta.from_columns([meta.global_indexes[2]], "p", {"image": shared.field_schema["image"]})
    with pytest.raises(DataNotReady):
        client.get_data(wanted)


def test_real_storage_nodes_hold_one_copy(valkey, namespace):
    nodes = start_local_nodes(valkey.url, namespace, n=2, capacity="64MiB")
    client = make_client(valkey.url, namespace, "dram", inline_max_bytes=4096)
    try:
        big = torch.arange(64 * 1024, dtype=torch.int64).reshape(1, -1)  # 512 KiB: goes to a node
        metas = [client.put_shared({"image": big + k}, _group(client, 8)) for k in range(2)]
        store = client.context.storage.store
        assert sum(s["keys"] for s in store.stats().values()) == 2  # one per group, not 16
        for k, meta in enumerate(metas):
            data = client.get_data(meta)
            assert data.batch_size == torch.Size([8]) and torch.equal(data["image"], (big + k).expand(8, -1))
        client.clear_samples(metas[0][0:7])
        assert sum(s["keys"] for s in store.stats().values()) == 2
        client.clear_samples(metas[0][7:8])
        assert sum(s["keys"] for s in store.stats().values()) == 1
        client.clear_partition("p")
        assert sum(s["keys"] for s in store.stats().values()) == 0
    finally:
        client.close()
        nodes.stop()


CLEARER = textwrap.dedent("""
    import json, sys
    from tq_redis import TransferQueueClient
    from tq_redis.meta import BatchMeta
    from tq_redis.ops import transitions

    url, ns, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    freed = []
    read = transitions._read_clear
    def recording(reply):
        got = read(reply)
        freed.extend(got.freed)
        return got
    transitions._read_clear = recording
    client = TransferQueueClient(url, ns)
    for i in ids:  # one sample per call: the clears of the processes interleave
        client.clear_samples(BatchMeta.from_columns([i], "p", {}))
    client.close()
    print(json.dumps(freed))
""")


def test_concurrent_clears_from_several_processes_free_each_value_exactly_once(real_server, namespace):
    client = make_client(real_server.url, namespace)
    try:
        groups = [_group(client, 4) for _ in range(8)]
        for k, meta in enumerate(groups):
            client.put_shared({"image": IMAGE + k}, meta)
        ids = [i for meta in groups for i in meta.global_indexes]
        # every member is cleared by two of the three processes, in different orders
        plans = [ids, list(reversed(ids)), ids[1::2]]
        procs = [subprocess.Popen([sys.executable, "-c", CLEARER, real_server.url, namespace, json.dumps(p)],
                                  stdout=subprocess.PIPE, text=True) for p in plans]
        outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        freed = [c for out in outs for c in json.loads(out)]
        assert len(freed) == len(groups) == len(set(freed))  # each carrier freed once, by one process
        assert _copies(client, "image") == 0 and _share_keys(client) == []
    finally:
        client.close()


KILLED = textwrap.dedent("""
    import os, signal, sys
    import torch
    from tq_redis import TransferQueueClient
    from tq_redis.meta import BatchMeta
    from tq_redis.ops import shared

    def die(*args, **kwargs):  # the bytes are stored: die before the script links them
        os.kill(os.getpid(), signal.SIGKILL)
    shared.transitions.share_put = die
    client = TransferQueueClient(sys.argv[1], sys.argv[2])
    meta = BatchMeta.from_columns([0, 1, 2], "p", {})
    client.put_shared({"image": torch.ones(1, 64)}, meta)
""")


def test_a_writer_sigkilled_after_storing_leaks_nothing(real_server, namespace):
    client = make_client(real_server.url, namespace)
    try:
        _group(client, 3)
        proc = subprocess.run([sys.executable, "-c", KILLED, real_server.url, namespace], timeout=DEADLINE_S)
        assert proc.returncode == -9
        assert _copies(client, "image") == 1  # stored, never linked: no member has it
        assert client.get_meta(["image"], 1, "p", task_name="t").size == 0
        client.clear_partition("p")
        assert _copies(client, "image") == 0 and _share_keys(client) == []
    finally:
        client.close()
