"""Process start method for multi-process tests.

``spawn`` would import torch afresh in every child (seconds each on 2 cores); ``fork`` would
copy the test runner's threads (fakeredis' server thread). A forkserver that preloads torch and
tq_redis once gives clean children quickly.
"""

from __future__ import annotations

import multiprocessing as mp
import os

_ctx = None


def mp_context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        # `import tq_redis` is lazy: name the modules a worker uses, so the children get them imported
        _ctx.set_forkserver_preload([
            "torch", "tensordict", "numpy", "redis", "tq_redis", "tq_redis.ops", "tq_redis.client.blocking",
            "tq_redis.client.aio", "tq_redis.backends.dram.store", "tq_redis.channel", "tq_redis.dock",
        ])
    return _ctx


def drain(producers: list, consumers: list, go, producers_done, out, timeout: float = 120) -> list:
    """Start ``producers`` and ``consumers`` (processes), release them all at once (``go``), wait
    for the producers to succeed, then tell the consumers (``producers_done``) and return the one
    result each consumer puts on ``out``, once every consumer exited with 0."""
    for p in producers + consumers:
        p.start()
    go.set()
    for p in producers:
        p.join(timeout)
        assert p.exitcode == 0, f"producer {p.name} exited with {p.exitcode}"
    producers_done.set()
    results = [out.get(timeout=timeout) for _ in consumers]
    for p in consumers:
        p.join(30)
        assert p.exitcode == 0, f"consumer {p.name} exited with {p.exitcode}"
    return results


def memfds(pid: int | str) -> set[str]:
    """Names of the storage-node slab memfds (``tq-dram-slab-*``) process ``pid`` holds open."""
    found = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if "tq-dram-slab" in target:
            found.add(target)
    return found


def shm_entries() -> set[str]:
    """Entries of /dev/shm that could belong to tq-redis (other programs' entries are ignored).

    multiprocessing's own semaphores (``sem.mp-<random>``) are left out: their random names can
    contain "tq", and they belong to the test's queues, not to tq-redis.
    """
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-") and ("tq" in n or "dram" in n)}


def up_attach(proc) -> tuple[str, str]:
    """``tq-redis up``'s banner (its lines up to the one saying how to stop it) and the attach URL
    from the file it names (the URL holds the password, which the banner never shows)."""
    import re
    import shlex

    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C" in line:
            break
    banner = "".join(lines)
    m = re.search(r"source (\S+)", banner)
    assert m, f"tq-redis up printed no attach file:\n{banner}"
    with open(m.group(1)) as f:
        url = re.search(r"^export TQ_REDIS_URL=(.+)$", f.read(), re.MULTILINE).group(1)
    return banner, shlex.split(url)[0]


def hang_after_store_put(client) -> None:
    """Make ``client``'s store print ``stored`` after each put and then wait on stdin: a test
    SIGKILLs the process there, with the bytes stored and the script that records them never run."""
    import sys

    from tq_redis import ops

    store = client.run(ops.storage(client.context))
    put = store.put

    def put_then_hang(*args):
        ring = put(*args)
        print("stored", flush=True)
        sys.stdin.readline()
        return ring

    store.put = put_then_hang


def gather(procs: list, out, timeout: float = 120) -> list:
    """Start ``procs`` and return the one result each puts on ``out``, once every one exited with 0."""
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    return results
