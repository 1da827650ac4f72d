"""DRAM storage-node wire safety: bounded frames, half-open connections, hostile peers on both sides.

Real node processes (``spawn_node``) on the suite's Valkey; a *fake node* (a socket server in this
process, registered in Redis like a node) plays the hostile side against the real client. Memory is
measured from ``/proc/<pid>/status`` (VmRSS) before and after.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import struct
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import _server
from tq_redis.backends.dram.launcher import _log_tail, spawn_node
from tq_redis.backends.dram.protocol import HEADER, OP_HELLO, PROTOCOL_VERSION, ST_AUTH, ST_OK, ProtocolError
from tq_redis.backends.dram.store import DramStore
from tq_redis.errors import StorageError, StorageUnavailable, TQError
from tq_redis.meta.keys import config_key, storage_nodes_key
from tq_redis.server.embedded import EmbeddedServer, free_port

MiB = 1 << 20
TOKEN = "wire-s3cret"


def rss(pid: int | str = "self") -> int:
    """Resident memory of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def slab_fds() -> int:
    """How many node slab memfds this process holds open (their names repeat across nodes)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += "tq-dram-slab" in os.readlink(f"/proc/self/fd/{fd}")
    return n


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def frame(op: int, meta: dict | None = None, payload: bytes = b"", *, mlen: int | None = None,
          plen: int | None = None) -> bytes:  # fmt: skip
    """A protocol message (lengths may lie: ``mlen``/``plen`` override the true ones)."""
    mb = msgpack.packb(meta, use_bin_type=True) if meta else b""
    mlen = len(mb) if mlen is None else mlen
    return HEADER.pack(op, 0, 0, mlen, len(payload) if plen is None else plen) + mb + payload


def hello(node, token: str | None = TOKEN) -> bytes:
    """A good HELLO to ``node``: its namespace, the access key it registered, the token."""
    return frame(OP_HELLO, {"v": PROTOCOL_VERSION, "ns": node.ns, "access": node.info["access"], "token": token,
                            "client": "fuzz", "shm": False})  # fmt: skip


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (whatever it sends first is read and dropped)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(1 << 16):
                return True
        except ConnectionError:
            return True


def dial(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.fixture(scope="module")
def token_node():
    """One node with a token and short timeouts (namespace per module), on the suite's Valkey."""
    ns = f"wire{uuid.uuid4().hex[:6]}"
    node = spawn_node(
        _server("valkey").url, ns, capacity="256MiB", token=TOKEN,
        extra_args=("--handshake-timeout", "1", "--io-timeout", "1"),
    )  # fmt: skip
    node.ns = ns
    yield node
    node.stop()


@pytest.fixture
def node_store(token_node, valkey):
    made = []

    def make(**kw) -> DramStore:
        s = DramStore(valkey.url, token_node.ns, token=TOKEN, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _round_trip(store: DramStore, tag: str) -> None:
    value = os.urandom(300_000)
    store.put([tag], [[value]])
    assert bytes(store.get([tag])[0]) == value
    store.delete([tag])


# ---------------------------------------------------------------------------------------------
# Node side: nothing is allocated before the handshake, and silence costs nothing lasting
# ---------------------------------------------------------------------------------------------

GARBAGE = {
    "32 garbage bytes": b"\xff" * 32,
    "an HTTP request": b"GET / HTTP/1.1\r\nHost: node\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n",
    "a HELLO claiming a 4 GiB header map": frame(OP_HELLO, mlen=0xFFFFFFFF) + b"\0" * 16,
    "a HELLO with a 1 TiB payload": frame(OP_HELLO, {"v": 1}, plen=1 << 40),
    "a PUT before HELLO": frame(2, {"keys": ["k"], "sizes": b"\x10" + b"\0" * 7}, plen=1 << 33),
}


def test_garbage_before_auth_is_closed_without_allocating(token_node, node_store):
    pid = token_node.proc.pid
    _round_trip(node_store(shm=False), "warm")  # the node's steady state before measuring
    before = rss(pid)
    for what, data in GARBAGE.items():
        with dial(token_node.address) as s:
            s.sendall(data)
            assert closed_within(s, 3), f"the node kept a connection open after {what}"
    after = rss(pid)
    assert after - before < 4 * MiB, f"node RSS grew from {before / MiB:.1f} to {after / MiB:.1f} MiB"
    assert token_node.proc.poll() is None
    log = _log_tail(token_node.log_file)
    assert "closing connection from 127.0.0.1" in log and "not a HELLO before the handshake" in log
    _round_trip(node_store(shm=False), "after-garbage")  # still serving
    print(f"node RSS under garbage: {before / MiB:.1f} MiB before, {after / MiB:.1f} MiB after")


def _hello_reply(address: str, uds: str | None, meta: dict) -> tuple[int, dict]:
    """Send one HELLO (over the node's unix socket when ``uds`` is given); the reply's status and map."""
    if uds:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("\0" + uds)
    else:
        s = dial(address)
    with s:
        s.sendall(frame(OP_HELLO, {"v": PROTOCOL_VERSION, "client": "t", "shm": bool(uds), **meta}))
        head = s.recv(HEADER.size, socket.MSG_WAITALL)
        code, _f, _r, mlen, _plen = HEADER.unpack(head)
        return code, msgpack.unpackb(s.recv(mlen, socket.MSG_WAITALL)) if mlen else {}


@pytest.mark.parametrize("path", ["tcp", "unix socket"])
def test_a_node_admits_only_its_namespace_with_its_access_key(token_node, node_store, path):
    """The access key comes from the namespace's registry; the token alone, or another namespace's
    name, or the key of a node of another namespace, gets nobody in (on TCP and on the unix socket)."""
    uds = token_node.info["uds"] if path == "unix socket" else None
    other = spawn_node(_server("valkey").url, token_node.ns + "-b", capacity="64MiB", token=TOKEN)
    try:
        ns, key = token_node.ns, token_node.info["access"]
        assert key != other.info["access"] and len(key) >= 40
        refused = [{"token": TOKEN}, {"token": TOKEN, "ns": ns}, {"token": TOKEN, "access": key},
                   {"token": TOKEN, "ns": ns + "-b", "access": key},
                   {"token": TOKEN, "ns": ns, "access": other.info["access"]},
                   {"token": TOKEN, "ns": ns, "access": key[:-1]}]  # fmt: skip
        for meta in refused:
            code, reply = _hello_reply(token_node.address, uds, meta)
            assert code == ST_AUTH and "access key" in reply["msg"], (meta, reply)
        code, reply = _hello_reply(token_node.address, uds, {"ns": ns, "access": key})  # no token
        assert code == ST_AUTH and "rejected the token" in reply["msg"]
        code, reply = _hello_reply(token_node.address, uds, {"ns": ns, "access": key, "token": TOKEN})
        assert code == ST_OK and reply["node_id"] == token_node.node_id
    finally:
        other.stop()
    store = node_store(shm=uds is not None)
    _round_trip(store, "access")  # the store reads the key from the registry by itself
    assert all("access" not in info for info in store.nodes())  # never handed out


def test_oversized_frames_after_auth_are_refused(token_node, node_store):
    pid = token_node.proc.pid
    before = rss(pid)
    with dial(token_node.address) as s:
        s.sendall(hello(token_node))
        s.sendall(frame(2, {"keys": ["k"], "sizes": struct.pack("<q", 1 << 40)}, plen=1 << 40))
        assert closed_within(s, 3)  # the reply to HELLO is read and dropped on the way
    with dial(token_node.address) as s:
        s.sendall(hello(token_node) + frame(6, mlen=0xFFFFFFF0))
        assert closed_within(s, 3)
    assert rss(pid) - before < 4 * MiB
    assert "limit is" in _log_tail(token_node.log_file)
    _round_trip(node_store(shm=False), "after-oversized")


def test_silent_and_stalled_connections_are_dropped(token_node, node_store):
    pid = token_node.proc.pid
    node_store(shm=False).stats()  # one pooled session, open throughout
    base = threads(pid)
    socks = [dial(token_node.address) for _ in range(20)]  # connect and say nothing
    socks[0].sendall(hello(token_node)[:7])  # stop in the middle of a header
    socks[1].sendall(hello(token_node)[:20])  # ... of a HELLO's header map
    socks[2].sendall(hello(token_node))  # authenticated, then stop in the middle of a request
    socks[2].sendall(frame(6, {"keys": ["k" * 50]})[:30])
    socks[3].sendall(b"\x01")  # a byte at a time, never a whole HELLO
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 5
        while threads(pid) < base + len(socks) and time.monotonic() < deadline:
            time.sleep(0.02)  # the node accepts them asynchronously
        assert threads(pid) >= base + len(socks) - 1  # one session thread each, for now
        for i, s in enumerate(socks):
            if i == 3:
                for _ in range(6):  # keeps trickling: the handshake deadline still ends it
                    if select.select([s], [], [], 0.3)[0]:
                        break
                    with contextlib.suppress(OSError):
                        s.send(b"\x00")
            assert closed_within(s, 5), f"connection {i} was not dropped"
        assert time.monotonic() - t0 < 6
        deadline = time.monotonic() + 5
        while threads(pid) > base and time.monotonic() < deadline:
            time.sleep(0.05)  # threads exit just after their sockets close
        assert threads(pid) == base, "a dropped connection left its thread behind"
    finally:
        for s in socks:
            s.close()
    _round_trip(node_store(shm=False), "after-silence")


def test_a_pooled_connection_the_node_dropped_is_replaced(valkey):
    ns = f"idle{uuid.uuid4().hex[:6]}"
    node = spawn_node(valkey.url, ns, capacity="64MiB", extra_args=("--idle-timeout", "0.5", "--io-timeout", "0.25"))
    try:
        with DramStore(valkey.url, ns, shm=False) as store:
            _round_trip(store, "a")
            (link,) = store._current_ring().links
            conn = link.idle[0]
            deadline = time.monotonic() + 5
            while not conn.closed_by_peer():  # the node closes it after 0.5 s idle
                assert time.monotonic() < deadline
                time.sleep(0.05)
            _round_trip(store, "b")  # a fresh connection, no error
    finally:
        node.stop()


def test_a_put_over_the_nodes_max_frame_is_refused_before_sending(valkey):
    from tq_redis.errors import InvalidArgument

    ns = f"mf{uuid.uuid4().hex[:6]}"
    node = spawn_node(valkey.url, ns, capacity="64MiB", extra_args=("--max-frame", "1MiB"))
    try:
        with DramStore(valkey.url, ns, shm=False) as tcp, DramStore(valkey.url, ns, shm=True) as local:
            with pytest.raises(InvalidArgument, match="exceeds the 1.0 MiB.*--max-frame"):
                tcp.put(["big"], [[b"x" * (2 * MiB)]])
            _round_trip(tcp, "small")  # the connection is still in step
            local.put(["big"], [[b"x" * (2 * MiB)]])  # shared memory: written in place, no frame
            assert len(local.get(["big"])[0]) == 2 * MiB
    finally:
        node.stop()


# ---------------------------------------------------------------------------------------------
# Client side: a fake node
# ---------------------------------------------------------------------------------------------


class FakeNode:
    """A socket server registered as a storage node; each connection gets ``script(request_no, op, meta)``.

    ``script`` returns the bytes to send back for that request (None: close the connection).
    """

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.instance = uuid.uuid4().hex
        self.script = lambda n, op, meta: None
        self.close_after = 1 << 30  # close the connection after this many replies
        self.stop = threading.Event()
        self.r = redis.Redis.from_url(redis_url)
        sec, _us = self.r.time()
        info = {"node_id": "fake", "instance": self.instance, "address": self.address, "host": "elsewhere",
                "shm": False, "heartbeat": sec + 3600, "capacity": 1 << 30}  # fmt: skip
        self.r.hset(storage_nodes_key(namespace), "fake", json.dumps(info))
        threading.Thread(target=self._accept, daemon=True).start()

    def ok_hello(self, **extra) -> bytes:
        return frame(0, {"node_id": "fake", "instance": self.instance, "shm": False, **extra})

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            n = 0
            while True:
                head = b""
                while len(head) < HEADER.size:
                    chunk = conn.recv(HEADER.size - len(head))
                    if not chunk:
                        return
                    head += chunk
                op, _f, _r, mlen, plen = HEADER.unpack(head)
                body = b""
                while len(body) < mlen + plen:
                    chunk = conn.recv(min(1 << 20, mlen + plen - len(body)))
                    if not chunk:
                        return
                    body += chunk
                meta = msgpack.unpackb(body[:mlen], raw=False) if mlen else {}
                reply = self.script(n, op, meta)
                n += 1
                if reply is None:
                    return
                conn.sendall(reply)
                if n > self.close_after:  # the scripted reply was the last word: the client sees EOF
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.lsock.close()
        self.r.close()


@pytest.fixture
def fake(valkey):
    ns = f"fake{uuid.uuid4().hex[:6]}"
    node = FakeNode(valkey.url, ns)
    node.ns = ns
    yield node
    node.close()


def _fake_store(valkey, fake, timeout_s: float = 2.0) -> DramStore:
    return DramStore(valkey.url, fake.ns, shm=False, timeout_s=timeout_s, refresh_s=60, dead_after_s=7200)


def test_a_fake_nodes_huge_hello_length_is_a_typed_error_and_allocates_nothing(valkey, fake):
    before = rss()
    fake.script = lambda n, op, meta: HEADER.pack(0, 0, 0, 0xFFFFFFF0, 0) + b"\0" * 64
    with _fake_store(valkey, fake) as store:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="fake.*header map"):
            store.put(["k"], [[b"v"]])
        assert time.monotonic() - t0 < 1.5
        fake.script = lambda n, op, meta: fake.ok_hello() if n == 0 else HEADER.pack(0, 0, 0, 0, 1 << 50)
        with pytest.raises(ProtocolError, match="payload"):
            store.get(["k"])
    assert rss() - before < 16 * MiB


def _deep(n: int) -> bytes:
    return b"\x81\xa1m" + b"\x91" * n + b"\xc0"


MALFORMED = {
    "FormatError": lambda fk: HEADER.pack(0, 0, 0, 1, 0) + b"\xc1",
    "StackError": lambda fk: HEADER.pack(0, 0, 0, len(_deep(5000)), 0) + _deep(5000),
    "not a map": lambda fk: frame(0, mlen=1) + b"\x07",
    "GET missing out of range": lambda fk: frame(0, {"missing": [5], "sizes": b""}),
    "GET sizes not 8-byte": lambda fk: frame(0, {"sizes": b"abc"}, b"abc"),
    "GET sizes wrong sum": lambda fk: frame(0, {"sizes": struct.pack("<q", 10)}, b"x" * 3),
    "GET negative size": lambda fk: frame(0, {"sizes": struct.pack("<q", -3)}, b""),
    "a refusal with a payload": lambda fk: frame(1, {"msg": "no"}, b"x" * 10),
    "msg not a string": lambda fk: frame(4, {"msg": [1, 2]}),
    "ExtraData": lambda fk: HEADER.pack(0, 0, 0, 2, 0) + b"\x80\x80",
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_malformed_replies_are_typed_errors(valkey, fake, what):
    fake.script = lambda n, op, meta: fake.ok_hello() if n == 0 else MALFORMED[what](fake)
    with _fake_store(valkey, fake) as store:
        with pytest.raises(StorageError) as err:
            store.get(["k"])
        assert "fake" in str(err.value)
        try:  # the same reply to a PUT: refused the same way, or (a GET's fields) a valid PUT reply
            store.put(["k"], [[b"v"]])
        except TQError as exc:
            assert isinstance(exc, StorageError), repr(exc)


# ---------------------------------------------------------------------------------------------
# Fuzz, both sides
# ---------------------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
field_names = st.sampled_from(["keys", "sizes", "txns", "unpin", "slabs", "commit", "shm", "v", "token", "ns",
                               "access", "msg", "missing", "offs", "lens", "pin", "chunks", "txn", "instance",
                               "fd_slabs", "live"])
metas = st.dictionaries(field_names | st.text(max_size=6), msgpack_values, max_size=6)
lengths = st.sampled_from([0, 1, 7, 100, 8 << 10, (8 << 10) + 1, 1 << 20, 0xFFFFFFFF]) | st.integers(0, 0xFFFFFFFF)
payload_lengths = st.sampled_from([0, 1, 100, 1 << 30, 1 << 40, (1 << 64) - 1]) | st.integers(0, 1 << 20)


@st.composite
def frames(draw) -> bytes:
    """A message as a peer could send it: well formed, lying about its lengths, truncated, or noise."""
    kind = draw(st.sampled_from(["noise", "well-formed", "lying", "truncated"]))
    if kind == "noise":
        return draw(st.binary(min_size=1, max_size=200))
    op = draw(st.integers(0, 255) | st.integers(0, 10))
    meta = draw(metas)
    payload = draw(st.binary(max_size=64))
    if kind == "well-formed":
        return frame(op, meta, payload)
    if kind == "lying":
        return frame(op, meta, payload, mlen=draw(lengths), plen=draw(payload_lengths))
    whole = frame(op, meta, payload)
    return whole[: draw(st.integers(0, max(0, len(whole) - 1)))]


def _fuzz_node(node, store: DramStore, data: list[bytes], authed: bool) -> None:
    with dial(node.address) as s:
        s.settimeout(5)
        with contextlib.suppress(OSError):
            if authed:
                s.sendall(hello(node))
            for chunk in data:
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)  # end of input: the node must not wait for more
        assert closed_within(s, 5), "the node neither answered nor closed the connection"


def _node_fuzz(token_node, store_factory, max_examples: int) -> None:
    pid = token_node.proc.pid
    store = store_factory(shm=False)
    _round_trip(store, "fuzz-warm")
    before = rss(pid)
    seen = {"examples": 0}

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(data=st.lists(frames(), min_size=1, max_size=4), authed=st.booleans())
    def fuzz(data, authed):
        seen["examples"] += 1
        _fuzz_node(token_node, store, data, authed)
        assert token_node.proc.poll() is None

    fuzz()
    after = rss(pid)
    assert token_node.proc.poll() is None
    assert after - before < 16 * MiB, f"node RSS grew from {before / MiB:.1f} to {after / MiB:.1f} MiB"
    _round_trip(store, "fuzz-after")  # well-formed requests are still served
    print(f"node fuzz: {seen['examples']} examples, RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB")


def test_fuzz_the_node_with_hostile_frames(token_node, node_store):
    _node_fuzz(token_node, node_store, max_examples=150)


@pytest.mark.soak
def test_fuzz_the_node_with_hostile_frames_soak(token_node, node_store):
    _node_fuzz(token_node, node_store, max_examples=1500)


def _client_fuzz(valkey, fake, max_examples: int) -> None:
    before = rss()
    outcomes = {"ok": 0, "typed": 0}

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(first=st.booleans(), reply=st.lists(frames(), min_size=1, max_size=2),
           op=st.sampled_from(["put", "get", "delete", "stats"]))
    def fuzz(first, reply, op):
        body = b"".join(reply)
        # the fuzzed bytes answer the HELLO itself, or the request after a good HELLO
        fake.script = lambda n, _op, _m: body if first else (fake.ok_hello() if n == 0 else body)
        fake.close_after = 0 if first else 1
        with _fake_store(valkey, fake, timeout_s=0.5) as store:
            try:
                if op == "put":
                    store.put(["a", "b"], [[b"x" * 10], [b"y" * 300]])
                elif op == "get":
                    store.get(["a", "b"])
                elif op == "delete":
                    store.delete(["a"])
                else:
                    store.stats()
                outcomes["ok"] += 1
            except TQError:
                outcomes["typed"] += 1

    fuzz()
    grew = rss() - before
    assert grew < 64 * MiB, f"the client grew by {grew / MiB:.1f} MiB"
    print(f"client fuzz: {outcomes}, RSS +{grew / MiB:.1f} MiB")


def test_fuzz_the_client_with_a_fake_node(valkey, fake):
    _client_fuzz(valkey, fake, max_examples=150)


@pytest.mark.soak
def test_fuzz_the_client_with_a_fake_node_soak(valkey, fake):
    _client_fuzz(valkey, fake, max_examples=1500)


# ---------------------------------------------------------------------------------------------
# Issue 14, item 10 and issue 13: timeouts, outages, dropped clients, the registry read
# ---------------------------------------------------------------------------------------------


def test_a_put_to_a_stopped_node_fails_after_one_timeout(valkey):
    """The client's put and its cleanup (deleting what it may have written) wait once, not twice."""
    import torch
    from tensordict import TensorDict

    from tq_redis import TransferQueueClient

    ns = f"stop{uuid.uuid4().hex[:6]}"
    node = spawn_node(valkey.url, ns, capacity="64MiB")
    client = TransferQueueClient(valkey.url, ns)
    spec = {"backend": "dram", "options": {"timeout_s": 1.0}, "inline_max_bytes": 0}  # the values go to the node
    client.redis.hset(config_key(ns), "storage", json.dumps(spec))
    try:
        data = TensorDict({"x": torch.arange(8).reshape(4, 2)}, batch_size=[4])
        client.put(data, partition_id="p")  # warm: connections made
        os.kill(node.proc.pid, signal.SIGSTOP)
        assert os.WIFSTOPPED(os.waitpid(node.proc.pid, os.WUNTRACED)[1])
        try:
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable, match="did not answer within 1 s"):
                client.put(data, partition_id="p")
            took = time.monotonic() - t0
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        assert took < 1.6, f"the put failed after {took:.2f} s with a 1 s node timeout"
        client.put(data, partition_id="p")  # the node is back: a short probe finds it
    finally:
        client.close()
        node.stop()


def test_puts_succeed_right_after_a_redis_outage_longer_than_the_heartbeat_window(tmp_path):
    """The registry keeps the nodes (AOF); their heartbeats are stale when Redis returns."""
    port = free_port()
    server = EmbeddedServer(port=port, data_dir=tmp_path, appendonly=True, appendfsync="always").start()
    node = spawn_node(server.url, "outage", capacity="64MiB", extra_args=("--heartbeat-s", "0.5"))
    try:
        store = DramStore(server.url, "outage", shm=False, dead_after_s=1.0, refresh_s=0)
        _round_trip(store, "before")
        server.stop(remove_data=False)
        time.sleep(2.0)  # the outage itself: longer than the 1 s liveness window
        server = EmbeddedServer(port=port, data_dir=tmp_path, appendonly=True, appendfsync="always").start()
        t0 = time.monotonic()
        store.put(["after"], [[b"v"]])  # no "no live DRAM storage node" while the node runs
        assert time.monotonic() - t0 < 2.0
        assert bytes(store.get(["after"])[0]) == b"v"
        store.close()
    finally:
        node.stop()
        server.stop()


def test_a_store_dropped_without_close_releases_its_memfds(valkey):
    ns = f"drop{uuid.uuid4().hex[:6]}"
    node = spawn_node(valkey.url, ns, capacity="64MiB")
    try:
        gc.collect()
        before = slab_fds()
        store = DramStore(valkey.url, ns, shm=True)
        store.put(["k"], [[np.zeros(1 << 20, np.uint8)]])  # 1 MiB: through shared memory
        assert slab_fds() > before, "the put did not map the node's slab"
        del store
        gc.collect()
        assert slab_fds() == before
    finally:
        node.stop()


class _Recorder:
    """Counts the commands a redis client sends (as one round trip each: no pipelines used)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr) and name not in ("close",):
            def call(*a, **kw):
                self.calls.append((name, a))
                return attr(*a, **kw)
            return call
        return attr


def test_the_registry_read_is_one_keyed_call(cluster_url_or_none, valkey):
    """One round trip, keyed by the registry key, so a Redis Cluster routes it to the key's node."""
    url = cluster_url_or_none or valkey.url
    ns = f"reg{uuid.uuid4().hex[:6]}"
    node = spawn_node(url, ns, capacity="64MiB")
    try:
        with DramStore(url, ns, shm=False) as store:
            store._read_registry()  # the first call also checks the server's library (once per store)
            store._registry.redis = recorder = _Recorder(store._registry.redis)
            now, nodes = store._read_registry()
            # a function of the library (a namespace's ACL user may not EVAL), keyed by the registry
            assert recorder.calls == [("execute_command", ("FCALL", "tq_read_registry", 1, storage_nodes_key(ns)))]
            assert list(nodes) == [node.node_id]
            assert abs(now - time.time()) < 5
            _round_trip(store, "reg")
    finally:
        node.stop()


@pytest.fixture(params=["single", "cluster"])
def cluster_url_or_none(request):
    if request.param == "single":
        return None
    from tests.cluster import get_cluster

    return get_cluster("valkey").url
