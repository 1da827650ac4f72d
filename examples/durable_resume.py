"""A job that loses every process, storage node and its Redis, and resumes from the durable tier.

Redis keeps its metadata in an AOF (``--appendonly``), ``storage.durable`` keeps every stored value
in a directory. The "job" puts samples, then everything is SIGKILLed; a new Redis started on the
same data directory, new storage nodes and a new client read every sample back, byte for byte,
and the final clear leaves no file in the tier.

Run: ``python examples/durable_resume.py``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tensordict import TensorDict

import tq_redis as tq
from tq_redis.backends.dram.launcher import spawn_node
from tq_redis.server.embedded import EmbeddedServer


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="tq-durable-example-"))
    tier = f"file://{work / 'tier'}"
    conf = {"namespace": "job", "storage": {"backend": "dram", "durable": tier}}

    redis_server = EmbeddedServer(data_dir=work / "redis", appendonly=True, appendfsync="always").start()
    nodes = [spawn_node(redis_server.url, "job", capacity="64MiB") for _ in range(2)]
    tq.init({**conf, "redis": {"url": redis_server.url}})
    rows = torch.arange(64 * 1024, dtype=torch.int64).reshape(64, 1024)  # 8 KiB a row: kept in the store
    meta = tq.get_client().put(TensorDict({"obs": rows}, batch_size=[64]), partition_id="step-0")
    tq.close()

    for node in nodes:  # the crash: every node and the Redis server, no clean shutdown
        node.proc.kill()
        node.proc.wait()
    redis_server.kill()

    # the restart: same Redis data directory (and port), new nodes, the same durable URL
    redis_server = EmbeddedServer(port=redis_server.port, data_dir=work / "redis", appendonly=True,
                                  appendfsync="always").start()
    nodes = [spawn_node(redis_server.url, "job", capacity="64MiB") for _ in range(2)]
    try:
        tq.init({"redis": {"url": redis_server.url}, "namespace": "job"})  # the recorded store and tier
        client = tq.get_client()
        again = client.get_meta(["obs"], meta.size, "step-0", mode="force_fetch")
        data = client.get_data(again)
        assert again.global_indexes == meta.global_indexes
        assert torch.equal(data["obs"].to_padded_tensor(0), rows), "bytes differ after the resume"
        client.clear_partition("step-0")
        left = [p for p in (work / "tier").rglob("*") if p.is_file()]
        assert not left, f"the clear left {len(left)} file(s) in the durable tier"
        tq.close()
    finally:
        for node in nodes:
            node.stop()
        redis_server.stop()
    print(f"durable_resume OK: {meta.size} samples read back after the whole job was killed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
