"""The attacker's side of tests/integration/test_redteam.py: run as another uid, it tries what a
local user or another namespace's client could try, and prints one JSON line saying what worked.

Run: ``python3 tests/integration/redteam_probe.py '<json plan>'`` (the tests start it as uid 65534).
It knows what the public source and the documentation tell anyone: the key layout, the storage
nodes' wire protocol, where to look for listening sockets (``/proc/net/unix``). It needs nothing
but the standard library (its own small RESP and msgpack codecs), so any interpreter another user
may run will do.

Plan keys (each optional):
    redis: [{"url": ..., "read": [[type, key], ...], "flushall": bool}]   a Redis to break into
                                                 (refused for want of a password, it tries every word
                                                 of every process's command line as the password)
    socket_files: [path, ...]                    socket files it tries to open
    nodes: [{"address": "host:port", "uds": name|null, "hello": [{...}, ...], "get": [key, ...],
             "steal": {"url": ..., "key": ...}}]   a node to read from; with "steal", every HELLO
                                                   field given as "@stolen" is tried with each secret
                                                   found in the registrations that URL may read
    scan_unix: prefix                            list abstract sockets starting with it
    commands: {"url": ..., "try": [[arg, ...], ...]}   commands sent as a namespace's user
"""

from __future__ import annotations

import array
import json
import mmap
import os
import socket
import struct
import sys
from typing import Any
from urllib.parse import unquote, urlsplit

HEADER = struct.Struct("<BBHIQ")
OP_HELLO, OP_GET, OP_FDS = 1, 6, 9
ST_OK = 0


# ---------------------------------------------------------------------------------------------
# A minimal Redis client (RESP2) and msgpack codec
# ---------------------------------------------------------------------------------------------


class RedisError(Exception):
    """An error reply."""


class Redis:
    """One connection to a Redis URL (``redis://[user:pw@]host:port`` or a socket path)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(30)
            self.sock.connect(parts.path)
        else:
            self.sock = socket.create_connection((parts.hostname, parts.port or 6379), timeout=30)
        self.buf = b""
        if parts.password:
            self.call("AUTH", *([unquote(parts.username)] if parts.username else []), unquote(parts.password))

    def call(self, *args: Any) -> Any:
        out = [f"*{len(args)}\r\n".encode()]
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        self.sock.sendall(b"".join(out))
        reply = self._read()
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed")
                self.buf += chunk
            data, self.buf = self.buf[:n], self.buf[n + 2 :]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def close(self) -> None:
        self.sock.close()


def pack(obj: Any) -> bytes:
    """msgpack of what a HELLO or GET carries: maps, lists, str, bytes, ints, bools, None."""
    if obj is None:
        return b"\xc0"
    if obj is True or obj is False:
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        return struct.pack(">Bq", 0xD3, obj)
    if isinstance(obj, str):
        raw = obj.encode()
        return struct.pack(">BI", 0xDB, len(raw)) + raw
    if isinstance(obj, bytes):
        return struct.pack(">BI", 0xC6, len(obj)) + obj
    if isinstance(obj, list | tuple):
        return struct.pack(">BI", 0xDD, len(obj)) + b"".join(pack(x) for x in obj)
    if isinstance(obj, dict):
        return struct.pack(">BI", 0xDF, len(obj)) + b"".join(pack(k) + pack(v) for k, v in obj.items())
    raise TypeError(type(obj))


def unpack(data: bytes) -> Any:
    value, _ = _unpack(data, 0)
    return value


def _unpack(d: bytes, i: int) -> tuple[Any, int]:  # noqa: C901 - one branch per msgpack type
    b = d[i]
    i += 1
    if b <= 0x7F:
        return b, i
    if b >= 0xE0:
        return b - 0x100, i
    if 0x80 <= b <= 0x8F:
        return _map(d, i, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _array(d, i, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return d[i : i + n].decode(errors="replace"), i + n
    fixed = {0xC0: None, 0xC2: False, 0xC3: True}
    if b in fixed:
        return fixed[b], i
    sized = {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"), 0xD9: (">B", "str"),
             0xDA: (">H", "str"), 0xDB: (">I", "str"), 0xDC: (">H", "arr"), 0xDD: (">I", "arr"),
             0xDE: (">H", "map"), 0xDF: (">I", "map")}  # fmt: skip
    if b in sized:
        fmt, kind = sized[b]
        (n,) = struct.unpack_from(fmt, d, i)
        i += struct.calcsize(fmt)
        if kind == "arr":
            return _array(d, i, n)
        if kind == "map":
            return _map(d, i, n)
        raw = d[i : i + n]
        return (raw if kind == "bin" else raw.decode(errors="replace")), i + n
    nums = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
            0xD2: ">i", 0xD3: ">q"}  # fmt: skip
    if b in nums:
        (v,) = struct.unpack_from(nums[b], d, i)
        return v, i + struct.calcsize(nums[b])
    raise ValueError(f"msgpack type {b:#x} not understood")


def _array(d: bytes, i: int, n: int) -> tuple[list, int]:
    out = []
    for _ in range(n):
        v, i = _unpack(d, i)
        out.append(v)
    return out, i


def _map(d: bytes, i: int, n: int) -> tuple[dict, int]:
    out = {}
    for _ in range(n):
        k, i = _unpack(d, i)
        v, i = _unpack(d, i)
        out[k] = v
    return out, i


# ---------------------------------------------------------------------------------------------
# The attempts
# ---------------------------------------------------------------------------------------------


def _cmdline_words() -> set[str]:
    """Every argument of every process's command line (anyone may read /proc/*/cmdline)."""
    words: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words.update(w.decode(errors="replace") for w in f.read().split(b"\0") if 8 <= len(w) <= 200)
        except OSError:
            continue
    return words


def _login(r: Redis) -> bool:
    """Whether a password read off some command line lets us in."""
    for word in sorted(_cmdline_words()):
        try:
            r.call("AUTH", word)
            return True
        except RedisError:
            continue
    return False


def _redis_attempts(target: dict[str, Any]) -> dict[str, Any]:
    """Read keys and FLUSHALL on a Redis with no password (or one from a command line); what came back."""
    got: dict[str, Any] = {"read": {}, "flushall": None}
    try:
        r = Redis(target["url"])
    except OSError as exc:
        return {"read": dict.fromkeys((k for _t, k in target.get("read", [])), f"unreachable: {exc}"),
                "flushall": f"unreachable: {exc}"}  # fmt: skip
    try:
        try:
            r.call("PING")
        except RedisError as exc:
            got["password_from_cmdline"] = "NOAUTH" in str(exc) and _login(r)
    except OSError:
        pass
    try:
        for kind, key in target.get("read", []):
            try:
                value = r.call("HGETALL" if kind == "hash" else "GET", key)
                got["read"][key] = bool(value)
            except RedisError as exc:
                got["read"][key] = f"refused: {str(exc)[:80]}"
        if target.get("flushall"):
            try:
                got["flushall"] = r.call("FLUSHALL") == b"OK"
            except RedisError as exc:
                got["flushall"] = f"refused: {str(exc)[:80]}"
    finally:
        r.close()
    return got


def _socket_file(path: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(path)
        s.sendall(b"*1\r\n$4\r\nPING\r\n")
        return "connected: " + s.recv(64).decode(errors="replace").strip()
    except OSError as exc:
        return f"refused: {type(exc).__name__}"
    finally:
        s.close()


def _frame(op: int, meta: dict[str, Any]) -> bytes:
    body = pack(meta)
    return HEADER.pack(op, 0, 0, len(body), 0) + body


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _reply(s: socket.socket, fds: list[int]) -> tuple[int, dict[str, Any], bytes]:
    """One reply: its status, header map and payload (slab fds passed with it go to ``fds``)."""
    data, anc, _flags, _addr = s.recvmsg(HEADER.size, socket.CMSG_SPACE(200 * 4))
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
    if not data:
        raise ConnectionError("closed")
    data += _recv_exact(s, HEADER.size - len(data))
    code, _f, _r, mlen, plen = HEADER.unpack(data)
    meta = unpack(_recv_exact(s, mlen)) if mlen else {}
    return code, meta, _recv_exact(s, plen) if plen else b""


def _node_attempt(connect: Any, hello: dict[str, Any], keys: list[str], local: bool) -> dict[str, Any]:
    """HELLO with what the attacker has; if let in, GET the keys (and map every slab over a unix socket)."""
    result: dict[str, Any] = {"hello": None, "bytes": 0}
    fds: list[int] = []
    try:
        s = connect()
    except OSError as exc:
        result["hello"] = f"unreachable: {type(exc).__name__}"
        return result
    try:
        s.settimeout(5)
        s.sendall(_frame(OP_HELLO, {**hello, "shm": local}))
        code, meta, _ = _reply(s, fds)
        result["hello"] = "ok" if code == ST_OK else f"refused ({code}): {str(meta.get('msg'))[:200]}"
        if code != ST_OK:
            return result
        if keys:
            s.sendall(_frame(OP_GET, {"keys": keys, "shm": False}))
            code, meta, payload = _reply(s, fds)
            result["bytes"] += len(payload)
        if local:  # the node's whole memory: every slab it will hand over
            s.sendall(_frame(OP_FDS, {"slabs": list(range(64))}))
            _reply(s, fds)
            for fd in fds:
                size = os.fstat(fd).st_size
                if size:
                    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                        result["bytes"] += size - m[:].count(0)
    except (OSError, ConnectionError, ValueError) as exc:
        result["hello"] = result["hello"] or f"dropped: {type(exc).__name__}"
    finally:
        for fd in fds:
            os.close(fd)
        s.close()
    return result


def _tcp(address: str):
    host, _, port = address.rpartition(":")
    return lambda: socket.create_connection((host, int(port)), timeout=5)


def _uds(name: str):
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(name if name.startswith("/") else "\0" + name)
        except OSError:
            s.close()
            raise
        return s

    return connect


def _abstract_sockets(prefix: str) -> list[str]:
    """Abstract unix sockets whose name starts with ``prefix`` (anyone may read /proc/net/unix)."""
    found = []
    with open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith("@" + prefix):
                found.append(parts[7][1:])
    return sorted(set(found))


def _commands(url: str, attempts: list[list[str]]) -> dict[str, str]:
    r = Redis(url)
    out = {}
    try:
        for args in attempts:
            try:
                r.call(*args)
                out[" ".join(args)[:60]] = "ran"
            except RedisError as exc:
                out[" ".join(args)[:60]] = f"refused: {str(exc)[:120]}"
    finally:
        r.close()
    return out


def _stolen(steal: dict[str, Any]) -> list[str]:
    """Every string in the registrations a namespace's user may read (its own nodes' secrets)."""
    r = Redis(steal["url"])
    try:
        flat = r.call("HGETALL", steal["key"])
    finally:
        r.close()
    found = set()
    for raw in flat[1::2]:
        info = json.loads(raw)
        found.update(v for v in info.values() if isinstance(v, str))
    return sorted(found)


def _hellos(node: dict[str, Any]) -> list[dict[str, Any]]:
    templates = node.get("hello", [{}])
    if "steal" not in node:
        return templates
    secrets = _stolen(node["steal"])
    out = []
    for t in templates:
        stolen = [k for k, v in t.items() if v == "@stolen"]
        if not stolen:
            out.append(t)
            continue
        out.extend({**t, **dict.fromkeys(stolen, value)} for value in secrets)
    return out


def main(plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"uid": os.getuid()}
    out["redis"] = [_redis_attempts(t) for t in plan.get("redis", [])]
    out["socket_files"] = {p: _socket_file(p) for p in plan.get("socket_files", [])}
    if "scan_unix" in plan:
        out["abstract"] = _abstract_sockets(plan["scan_unix"])
    nodes = []
    for node in plan.get("nodes", []):
        tries = []
        for hello in _hellos(node):
            tries.append(_node_attempt(_tcp(node["address"]), hello, node.get("get", []), False))
            if node.get("uds"):
                tries.append(_node_attempt(_uds(node["uds"]), hello, node.get("get", []), True))
        nodes.append(tries)
    out["nodes"] = nodes
    if "commands" in plan:
        out["commands"] = _commands(plan["commands"]["url"], plan["commands"]["try"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
