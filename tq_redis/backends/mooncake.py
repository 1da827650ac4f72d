"""The ``mooncake`` store: values kept in a Mooncake distributed store (``mooncake-transfer-engine``).

Mooncake has a *master* (``mooncake_master``: metadata and placement) and *segments*: memory that
store clients mount into the cluster, where the values live. Options (the ``storage.options`` of
the namespace's config)::

    {"master_server_address": "10.0.0.1:50051",   # required
     "metadata_server": "P2PHANDSHAKE",            # or "host:port" / "http://..." / "etcd://..."
     "protocol": "tcp",                            # "rdma" in production
     "device_name": "",                            # RDMA NICs, e.g. "mlx5_0,mlx5_1"
     "local_hostname": None,                       # default: this host's address towards the master
     "global_segment_size": 0,                     # memory this client mounts, e.g. "4GiB"
     "local_buffer_size": 0,                       # the library's own staging buffer (unused here)
     "replica_num": 1, "hard_pin": True}

**Where values live.** By default a tq-redis client mounts no memory (``global_segment_size: 0``):
the values then live in long-running segment holders, e.g. ``mooncake_client
--global_segment_size=64GB --master_server_address=... --metadata_server=P2PHANDSHAKE``, so they
outlive the producer that wrote them (a client's own segment is unmounted, with every value in
it, when the client closes or dies). Set ``global_segment_size`` to make each client contribute
memory instead, as the reference system does. Values are hard-pinned (``hard_pin``): Mooncake never
evicts them; a full cluster refuses the write with :class:`~tq_redis.errors.StorageFull`.

**Transfers.** A put copies each value's segments once, straight into one staging buffer per
batch (no per-value ``bytes`` join), registers that buffer with the transfer engine and stores
every value with one ``batch_upsert_from`` (Mooncake's multi-buffer put would avoid that copy, but
it silently keeps an existing value instead of overwriting it). A get asks the master for every
value's size (``batch_get_replica_desc``), allocates one buffer, registers it, and reads all values
into it with one ``batch_get_into``; it returns read-only views of that buffer (no further copy). A
value being overwritten is unreadable until the write ends: a get waits for it (up to 10 s), so it
returns the old value or the new one, never a torn one. Mooncake cannot store an empty value, so
every value is stored with one marker byte after it, which the views leave out.

**Errors.** An unreachable master raises :class:`~tq_redis.errors.StorageUnavailable` naming its
address (checked with a TCP connect before the library's own minute-long retries); absent keys
raise :class:`~tq_redis.errors.DataMissing` naming them; a missing package raises
:class:`~tq_redis.errors.BackendNotInstalled` naming ``mooncake-transfer-engine``.

**Clients, threads and processes.** A Mooncake client is heavy (a transfer engine with its ports
and threads; leaving a cluster blocks the whole interpreter for about a second), so a process keeps
one per cluster configuration, shared by every store built with it, and leaves at exit
(:func:`close_clients` leaves earlier); ``close()`` only stops that store. Thread-safe (the Mooncake
client is). A store used after ``fork()`` joins the cluster anew in the child.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis.backends import external
from tq_redis.errors import ConfigError, StorageError, StorageFull, StorageUnavailable
from tq_redis.storage.base import Buffer, Segments
from tq_redis.units import parse_size

_mooncake = external.import_client(
    "mooncake.store", "mooncake", "the Mooncake client library",
    "pip install mooncake-transfer-engine (CUDA builds) or mooncake-transfer-engine-non-cuda; "
    "the TCP/RDMA transport also needs the system library libibverbs1 (apt-get install libibverbs1)",
)  # fmt: skip
MooncakeDistributedStore, ReplicateConfig = _mooncake.MooncakeDistributedStore, _mooncake.ReplicateConfig

__all__ = ["MooncakeStore", "close_clients"]

_KEYS_PER_CALL = 1024
_BYTES_PER_CALL = 256 << 20  # a put's staging buffer holds at most this much (or one larger value)
_WRITE_WAIT_S = 10.0  # how long a read waits for a value being written, or a write for another writer
_PROBE_TIMEOUT_S = 3.0

# mooncake-store's ErrorCode values met here (the Python binding returns bare integers)
_NOT_FOUND = -704
_ERRORS = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (no space left in the mounted segments)",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (master unreachable)",
}
_READ_TRANSIENT = {-600, -703}  # being written; -600: the value grew since its size was asked
_WRITE_TRANSIENT = {-703, -705, -706}  # another writer of the same key holds it for a moment
_UNAVAILABLE = {-900, -800}
_FULL = {-200}

_OPTIONS = frozenset(
    {
        "master_server_address", "metadata_server", "protocol", "device_name", "local_hostname",
        "global_segment_size", "local_buffer_size", "replica_num", "hard_pin",
    }
)  # fmt: skip


def _code(code: int) -> str:
    return f"{code} {_ERRORS.get(code, 'error')}"


def _option_size(name: str, value: Any) -> int:
    """A byte count from an int or a string such as ``"4GiB"``; 0 is allowed."""
    if value in (0, "0", None):
        return 0
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"mooncake store option {name!r}: {exc}") from None


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"mooncake store: master_server_address must be 'host:port' (e.g. '127.0.0.1:50051'), not {address!r}"
        )
    return host.strip("[]"), int(port)


def _metadata_server(value: str) -> str:
    text = str(value).strip()
    if text.upper() == "P2PHANDSHAKE":
        return "P2PHANDSHAKE"
    if text.startswith("etcd://") or text.startswith("redis://"):
        return text
    if not text.startswith("http://"):
        text = f"http://{text}"
    return text if text.endswith("/metadata") else f"{text}/metadata"


def _address_towards(host: str, port: int) -> str:
    """This host's IP address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


_CLIENTS: dict[tuple[Any, ...], Any] = {}  # (pid, cluster configuration) -> Mooncake client
_CLIENTS_LOCK = threading.Lock()
_AT_EXIT = False  # close_clients is registered with atexit


def close_clients() -> None:
    """Leave every Mooncake cluster this process joined (run at exit; about a second per client).

    Stores built afterwards join again. A client that mounted memory (``global_segment_size``)
    takes the values in it along.
    """
    with _CLIENTS_LOCK:
        mine = [k for k in _CLIENTS if k[0] == os.getpid()]
        natives = [_CLIENTS.pop(k) for k in mine]
    for native in natives:
        _close_quietly(native)


def _close_quietly(native: Any) -> None:
    try:
        native.close()
    except Exception:  # noqa: BLE001 - shutting down; nothing useful to report
        pass


class MooncakeStore(external.OptionsStore):
    """Stores values in a Mooncake cluster (see the module docstring).

    Args:
        master_server_address: ``host:port`` of ``mooncake_master``'s RPC service.
        metadata_server: ``"P2PHANDSHAKE"`` (no metadata service) or the HTTP / etcd metadata server.
        protocol: transfer protocol, ``"tcp"`` or ``"rdma"``.
        device_name: RDMA device names (``""`` for TCP).
        local_hostname: the address other nodes reach this client at (default: this host's address
            on the route to the master).
        global_segment_size: bytes of memory this client mounts into the cluster (0: none).
        local_buffer_size: bytes of the library's own staging buffer (this store does not use it).
        replica_num: copies of each value.
        hard_pin: never let Mooncake evict a value (a full cluster refuses writes instead).
    """

    name = "mooncake"
    OPTIONS = _OPTIONS

    def __init__(
        self,
        master_server_address: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        local_hostname: str | None = None,
        global_segment_size: int | str = 0,
        local_buffer_size: int | str = 0,
        replica_num: int = 1,
        hard_pin: bool = True,
    ) -> None:
        if not isinstance(master_server_address, str) or not master_server_address:
            raise ConfigError(
                "the mooncake store needs a 'master_server_address' option ('host:port' of mooncake_master)"
            )
        self.master = master_server_address
        self._master_host, self._master_port = _host_port(master_server_address)
        self.metadata_server = _metadata_server(metadata_server)
        self.protocol = str(protocol)
        self.device_name = str(device_name or "")
        self.local_hostname = local_hostname or _address_towards(self._master_host, self._master_port)
        self.global_segment_size = _option_size("global_segment_size", global_segment_size)
        self.local_buffer_size = _option_size("local_buffer_size", local_buffer_size)
        if not isinstance(replica_num, int) or replica_num < 1:
            raise ConfigError(f"mooncake store option 'replica_num' must be a positive integer, not {replica_num!r}")
        self._config = ReplicateConfig()
        self._config.replica_num = replica_num
        self._config.with_hard_pin = bool(hard_pin)
        self._connection = external.ProcessConnection("mooncake", self._shared_client)

    # ------------------------------------------------------------------ connection

    def _shared_client(self) -> Any:
        """This process's Mooncake client for this cluster configuration (created on first use)."""
        key = (
            os.getpid(), self.master, self.metadata_server, self.protocol, self.device_name,
            self.local_hostname, self.global_segment_size, self.local_buffer_size,
        )  # fmt: skip
        global _AT_EXIT
        with _CLIENTS_LOCK:
            native = _CLIENTS.get(key)
            if native is None:
                native = _CLIENTS[key] = self._connect()
                if not _AT_EXIT:
                    atexit.register(close_clients)
                    _AT_EXIT = True
            return native

    def _connect(self) -> Any:
        external.probe(
            self._master_host, self._master_port, _PROBE_TIMEOUT_S, f"the Mooncake master at {self.master}",
            f"is mooncake_master running with --rpc_port={self._master_port}?",
        )  # fmt: skip
        native = MooncakeDistributedStore()
        ret = native.setup(
            self.local_hostname, self.metadata_server, self.global_segment_size, self.local_buffer_size,
            self.protocol, self.device_name, self.master,
        )  # fmt: skip
        if ret != 0:
            _close_quietly(native)
            raise StorageUnavailable(
                f"could not join the Mooncake cluster of the master at {self.master} (setup returned {ret}; "
                f"metadata_server={self.metadata_server!r}, protocol={self.protocol!r}, "
                f"local_hostname={self.local_hostname!r})"
            )
        return native

    @property
    def _store(self) -> Any:
        return self._connection.get()

    def _fail(self, what: str, code: int, keys: Sequence[str]) -> StorageError:
        message = f"mooncake store: cannot {what} {external.named(keys)}: {_code(code)} (master {self.master})"
        if code in _UNAVAILABLE:
            return StorageUnavailable(message)
        if code in _FULL:
            return StorageFull(
                message + "; mount more memory (mooncake_client --global_segment_size=...) or delete data"
            )
        return StorageError(message)

    # ------------------------------------------------------------------ put

    def put(self, keys: Sequence[str], values: Sequence[Segments]) -> None:
        """Store every value (overwriting): segments are copied once, into one staging buffer."""
        order, views, sizes = external.put_plan(keys, values)  # a key given twice keeps its last value
        for start, end, total in external.batches(sizes, _KEYS_PER_CALL, _BYTES_PER_CALL):
            self._put_chunk([keys[i] for i in order[start:end]], views[start:end], sizes[start:end], total)

    def _put_chunk(self, keys: list[str], views: list[list[memoryview]], sizes: list[int], total: int) -> None:
        staging = np.empty(total, dtype=np.uint8)
        dst = memoryview(staging)
        base = staging.ctypes.data
        ptrs: list[int] = []
        offset = 0
        for segs in views:
            ptrs.append(base + offset)
            offset = external.write_marked(dst, segs, offset)
        store = self._store
        with _Registered(store, base, total, self.master):
            todo = list(range(len(keys)))
            deadline = time.monotonic() + _WRITE_WAIT_S
            delay = 0.001
            while True:
                codes = store.batch_upsert_from(
                    [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo], config=self._config
                )
                failed = [(i, c) for i, c in zip(todo, codes) if c != 0]
                if not failed:
                    return
                # another writer of the same key may hold it for a moment; anything else is final
                final = [c for _, c in failed if c not in _WRITE_TRANSIENT]
                if final or time.monotonic() > deadline:
                    code = final[0] if final else failed[0][1]
                    raise self._fail("write", code, [keys[i] for i, c in failed if c == code])
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
                todo = [i for i, _ in failed]

    # ------------------------------------------------------------------ get

    def get(self, keys: Sequence[str]) -> list[Buffer]:
        """Read every value into one buffer and return views of it; raise ``DataMissing`` naming absent keys."""
        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        found: dict[str, memoryview] = {}
        for start in range(0, len(unique), _KEYS_PER_CALL):
            found.update(self._get_chunk(unique[start : start + _KEYS_PER_CALL]))
        absent = [k for k in unique if k not in found]
        if absent:
            raise external.missing(absent, f"the mooncake store (master {self.master})")
        return [found[k] for k in keys]

    @staticmethod
    def _sizes(store: Any, keys: list[str]) -> dict[str, int]:
        """Stored size of every key the master has a readable copy of."""
        sizes: dict[str, int] = {}
        for key, replicas in store.batch_get_replica_desc(keys).items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[key] = replica.get_memory_descriptor().buffer_descriptor.size
                    break
            else:  # on disk only (offload)
                size = store.get_size(key)
                if size > 0:
                    sizes[key] = size
        return sizes

    def _get_chunk(self, keys: list[str]) -> dict[str, memoryview]:
        """Read ``keys``' values into one buffer; absent keys are left out of the result.

        The master does not tell an absent key from one being written, or from its own failure, in
        ``batch_get_replica_desc``; keys without a size are therefore read into a 1-byte slot, and
        ``batch_get_into`` says which it is: an empty value, absent (-704), being written (-703:
        wait), larger (-600: ask its size again) or an error.
        """
        store = self._store
        found: dict[str, memoryview] = {}
        todo = keys
        deadline = time.monotonic() + _WRITE_WAIT_S
        delay = 0.001
        while True:
            sizes = self._sizes(store, todo)
            lengths = [sizes.get(k, 1) for k in todo]
            offsets = list(itertools.accumulate(lengths[:-1], initial=0))
            total = offsets[-1] + lengths[-1]
            buffer = np.empty(total, dtype=np.uint8)
            base = buffer.ctypes.data
            with _Registered(store, base, total, self.master):
                codes = store.batch_get_into(todo, [base + o for o in offsets], lengths)
            view = memoryview(buffer).toreadonly()
            retry: list[str] = []
            for key, offset, code in zip(todo, offsets, codes):
                if code > 0:
                    found[key] = external.unmarked(view[offset : offset + code], "mooncake", key)
                elif code == _NOT_FOUND:
                    continue
                elif code in _READ_TRANSIENT:
                    retry.append(key)
                else:
                    raise self._fail("read", code, [key])
            if not retry:
                return found
            if time.monotonic() > deadline:
                raise self._fail(f"read (still being written after {_WRITE_WAIT_S:g} s)", -703, retry)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
            todo = retry

    # ------------------------------------------------------------------ delete

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the values of ``keys``; absent ones are ignored."""
        if not keys:
            return
        store = self._store
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), _KEYS_PER_CALL):
            chunk = unique[start : start + _KEYS_PER_CALL]
            codes = store.batch_remove(chunk, force=True)
            failed = [(k, c) for k, c in zip(chunk, codes) if c not in (0, _NOT_FOUND)]
            if failed:
                raise self._fail("delete", failed[0][1], [k for k, _ in failed])

    def close(self) -> None:
        """Stop using this store; the process's shared Mooncake client stays until exit (see above)."""
        self._connection.close()

    def __repr__(self) -> str:
        return f"MooncakeStore(master={self.master!r}, protocol={self.protocol!r})"


class _Registered:
    """Registers a buffer with the transfer engine for the duration of a transfer (needed for RDMA)."""

    def __init__(self, store: Any, ptr: int, size: int, master: str) -> None:
        self.store, self.ptr, self.size, self.master = store, ptr, size, master

    def __enter__(self) -> None:
        ret = self.store.register_buffer(self.ptr, self.size)
        if ret != 0:
            raise StorageError(f"mooncake store: cannot register a {self.size}-byte buffer: {_code(ret)}")

    def __exit__(self, *exc: object) -> None:
        self.store.unregister_buffer(self.ptr)
