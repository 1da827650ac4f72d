"""DRAM storage nodes placed by Ray: one per Ray node, and ranks that use their local one's shared memory.

``place_storage_nodes`` starts a keeper actor pinned to every Ray node (node affinity, ``num_cpus=0``,
restarted by Ray if it fails); each keeper runs a storage node that registers itself in Redis. Rank
actors pinned to a Ray node then put and get through tq-redis as usual: the ``dram`` store reaches
the node on their own host through shared memory and the others over TCP, with no configuration.

Run: ``python examples/ray_placement.py`` (a local one-node Ray and an embedded Valkey). On a
cluster: ``RAY_ADDRESS=auto TQ_REDIS_URL=redis://meta-host:6379/0 python examples/ray_placement.py``
(the Redis URL must be reachable from every Ray node).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tq_redis as tq  # noqa: E402
from tq_redis.integrations.ray_placement import local_storage_node, place_storage_nodes  # noqa: E402

SAMPLES, WIDTH = 32, 8192  # 32 samples of 32 KiB: big enough for the shared-memory path


@ray.remote(num_cpus=0)
class Rank:
    """A trainer/rollout rank: its own client, nothing but the Redis URL and the namespace."""

    def __init__(self, url: str, namespace: str, rank: int) -> None:
        self.url, self.namespace, self.rank = url, namespace, rank
        self.client = tq.TransferQueueClient(url, namespace)

    def run(self) -> dict:
        partition = f"rank-{self.rank}"
        x = torch.arange(SAMPLES * WIDTH, dtype=torch.float32).reshape(SAMPLES, WIDTH) + self.rank
        put = self.client.put(TensorDict({"x": x}, batch_size=[SAMPLES]), partition_id=partition)
        row_of = {g: i for i, g in enumerate(put.global_indexes)}
        meta = self.client.get_meta(["x"], SAMPLES, partition, task_name="check", timeout=10)
        data = self.client.get_data(meta)["x"].to_padded_tensor(0)  # nested, as the reference returns
        ok = torch.equal(data, x[[row_of[g] for g in meta.global_indexes]])
        self.client.clear_partition(partition)
        local = local_storage_node(self.url, self.namespace)
        return {"rank": self.rank, "ok": ok, "local": local.node_id if local else None,
                "route": local.route if local else None}  # fmt: skip


def main() -> int:
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # no driver-local storage nodes (units 0): Ray places them, one per Ray node
    cfg = tq.init({"storage": {"backend": "dram", "units": 0}})
    url, ns = cfg["redis"]["url"], cfg["namespace"]
    placement = place_storage_nodes(url, ns, capacity="256MiB")
    try:
        placed = placement.wait_ready(timeout=60)
        for ray_node_id, nodes in placed.items():
            for node in nodes:
                print(f"Ray node {ray_node_id[:12]}: storage node {node.node_id[:16]}... at {node.address} "
                      f"(host {node.host}, pid {node.pid})")  # fmt: skip
        ranks = [
            Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False)).remote(
                url, ns, 2 * i + j
            )
            for i, ray_node_id in enumerate(sorted(placed))
            for j in range(2)
        ]
        results = ray.get([r.run.remote() for r in ranks])
        for r in results:
            print(f"rank {r['rank']}: data ok={r['ok']}, local storage node {r['local'][:16]}... via {r['route']}")
        good = all(r["ok"] and r["route"] == "shm" for r in results)
    finally:
        placement.shutdown()
        tq.close()
        ray.shutdown()
    if not good:
        print("ray_placement FAILED")
        return 1
    print(
        f"ray_placement OK: {len(results)} ranks on {len(placed)} Ray node(s), each via its local node's shared memory"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
