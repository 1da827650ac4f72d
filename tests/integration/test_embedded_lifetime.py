"""The embedded server and the storage nodes ``init()`` starts live exactly as long as the process
that started them: not less when ``init`` ran in a thread that has ended since (Linux's
parent-death signal follows the thread that forked a child, not its process), and not more when
that process is SIGKILLed. Real processes: a Python child runs ``init`` in a thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

DEADLINE_S = 60

# Runs init() in a worker thread that then ends, waits until that thread is gone from the kernel
# too, and keeps using the embedded server and nodes for a while; prints what it found, then waits
# on stdin (the test SIGKILLs it).
CHILD = r"""
import json, os, sys, threading, time
import torch
from tensordict import TensorDict
import tq_redis as tq

started = {}

def start():
    started["tid"] = threading.get_native_id()
    started["cfg"] = tq.init()

worker = threading.Thread(target=start)
worker.start()
worker.join()
give_up = time.monotonic() + 60
while os.path.exists(f"/proc/self/task/{started['tid']}"):  # the OS thread exits after join returns
    assert time.monotonic() < give_up, "the init thread never exited"
    time.sleep(0.01)
client = tq.get_client()
rounds, until = 0, time.monotonic() + 2.0
while time.monotonic() < until or rounds < 20:  # a real workload for a while, not one ping
    meta = client.put(TensorDict({"x": torch.arange(4) + rounds}, batch_size=[4]), partition_id="p")
    assert client.get_data(meta)["x"].tolist() == [rounds, rounds + 1, rounds + 2, rounds + 3]
    rounds += 1
big = client.put(TensorDict({"y": torch.ones(4, 4096)}, batch_size=[4]), partition_id="q")  # held by the nodes
assert float(client.get_data(big)["y"].to_padded_tensor(0).sum()) == 4 * 4096
ns = started["cfg"]["namespace"]
nodes = [json.loads(v)["pid"] for v in client.redis.hvals(f"{ns}:storage:nodes")]
print(json.dumps({"server": int(client.redis.info("server")["process_id"]), "nodes": nodes, "rounds": rounds}),
      flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it runs no more)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still running after waiting up to DEADLINE_S for all of them to end."""
    give_up = time.monotonic() + DEADLINE_S
    while time.monotonic() < give_up:
        left = [p for p in pids if not _gone(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


@pytest.fixture
def embedded_env(monkeypatch):
    env = dict(os.environ)
    for name in ("TQ_REDIS_URL", "TQ_NAMESPACE", "TQ_REDIS_DURABLE"):
        env.pop(name, None)
    return env


def test_init_in_a_thread_that_ends_keeps_the_server_and_nodes_until_the_process_is_killed(embedded_env):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], env=embedded_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = child.stdout.readline()
        if not line:
            child.wait(DEADLINE_S)
            pytest.fail(f"the child failed after its init thread ended (code {child.returncode}):\n"
                        f"{child.stderr.read()[-4000:]}")
        found = json.loads(line)
        assert found["rounds"] >= 20 and len(found["nodes"]) >= 1
        pids = [found["server"], *found["nodes"]]
        assert not any(_gone(p) for p in pids)
        child.send_signal(signal.SIGKILL)
        child.wait(DEADLINE_S)
        assert _wait_gone(pids) == [], "the server or a node outlived the SIGKILLed process that started it"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
