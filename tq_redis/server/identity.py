"""A namespace's identity: the ``epoch`` drawn when it is created, so a Redis that lost its state is
noticed and refused instead of trusted.

A Redis restarted without persistence, a replica promoted without the data, a ``FLUSHALL`` or a
drop leave a namespace's keys gone while its clients and storage nodes carry on. Without a check,
the next insert hands out ids 0, 1, ... again, metadata taken before reads the new rows' bytes, and
a process attaching afterwards finds no ``<ns>:config`` and quietly uses other settings. So:

* The namespace carries an ``epoch`` (16 random hex digits) in ``<ns>:config``, drawn once by the
  first client that finds none (``HSETNX``: concurrent first clients agree on one). A namespace
  with storage nodes has it copied in ``<ns>:storage:epoch``, the one key of it a storage node may
  read besides its registry (``<ns>:config`` may hold a store's credentials).
* Every client learns it before its first call (:class:`Identity`, :func:`tq_redis.ops.identity.learn`)
  and checks it again on every new Redis connection (:meth:`Identity.check_connection`, before the
  connection's first command: a reconnect after a restart is when a server that lost its state is
  met) and in the liveness heartbeat (:mod:`tq_redis.client.liveness`). A missing or different epoch
  raises :class:`~tq_redis.errors.ServerStateLost`, and every later call of that client raises it
  too: its ids and metadata belong to a namespace that no longer exists.
* Storage nodes copy the epoch into their registration (``"epoch"`` in ``<ns>:storage:nodes``) and
  keep it while the namespace has none, so a process attaching to a namespace whose config is gone
  while live nodes still serve its old bytes is refused rather than starting afresh (with the
  ``redis`` store, while the others wrote to the nodes). A namespace created fresh has no config and
  no node that carries an epoch; a lost one has nodes that do.
* ``load_checkpoint`` takes the namespace as it finds it (:meth:`Identity.restored`): an epoch present
  is kept, a missing one drawn anew, and the loading client adopts it; nodes follow the epoch the
  namespace has.

On a Redis Cluster the connection check runs on connections to the node that holds ``<ns>:config``
(another node answers ``MOVED`` and is left to the heartbeat), and asyncio cluster clients rely on
the heartbeat alone.
"""

from __future__ import annotations

import json
import secrets
import threading
from typing import Any

import redis

from tq_redis.errors import ServerStateLost
from tq_redis.meta.keys import config_key, storage_epoch_key
from tq_redis.redact import redact

__all__ = ["FIELD", "NODE_LIVE_S", "Identity", "foreign_nodes", "new_epoch", "text"]

#: the field of ``<ns>:config`` (and of a node's registration) that holds the namespace's epoch
FIELD = "epoch"
#: a node whose registration was written within this many seconds counts as live here
NODE_LIVE_S = 10.0


def new_epoch() -> str:
    """A fresh epoch: 16 random hex digits."""
    return secrets.token_hex(8)


def text(value: Any) -> str | None:
    """A reply as text (None stays None)."""
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def foreign_nodes(registrations: dict[Any, Any], now_s: float, epoch: str | None) -> dict[str, str]:
    """Node id -> epoch of the live nodes whose registration carries an epoch other than ``epoch``
    (None: any epoch at all). Registrations that are not ours to read are left out."""
    found = {}
    for node_id, raw in registrations.items():
        try:
            info = json.loads(raw)
            fresh = now_s - float(info.get("heartbeat", 0)) <= NODE_LIVE_S
        except (TypeError, ValueError, AttributeError):
            continue
        theirs = info.get(FIELD)
        if fresh and isinstance(theirs, str) and theirs != epoch:
            found[text(node_id) or ""] = theirs
    return found


class Identity:
    """What one client knows of its namespace's identity: the epoch it learned, and whether the
    server was since found to have lost the namespace (then every call raises)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.key = config_key(namespace)
        self.mirror_key = storage_epoch_key(namespace)
        self.epoch: str | None = None
        self.lost: str | None = None  # the message of the ServerStateLost every call raises
        self.lost_event = threading.Event()  # set once ``lost`` is
        self.restoring = False  # a checkpoint load is taking the namespace up: connections go unchecked
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Identity(namespace={self.namespace!r}, epoch={self.epoch!r}, lost={self.lost is not None})"

    def check(self) -> None:
        """Raise :class:`ServerStateLost` if the namespace was found lost."""
        if self.lost is not None:
            raise ServerStateLost(self.lost)

    def refuse(self, what: str) -> ServerStateLost:
        """Record that the namespace is lost (``what`` says how it was seen); the error to raise."""
        with self._lock:
            if self.lost is None:
                self.lost = (
                    f"the Redis at {redact(self.url)} no longer holds namespace {self.namespace!r} as this client "
                    f"knew it: {what}. It restarted without persistence, a replica without the data was "
                    f"promoted, or the namespace was flushed or dropped; ids and metadata from before would "
                    f"name rows that no longer exist. Nothing was sent. Restore a checkpoint "
                    f"(tq_redis.load_checkpoint(dir), or this client's load_storage_checkpoint), or start "
                    f"a new namespace; this client refuses every call until then"
                )
                self.lost_event.set()
        return ServerStateLost(self.lost)

    def adopt(self, epoch: str) -> None:
        """Take ``epoch`` as the namespace's (learned at first use); a different one learned
        before means the namespace was re-created under this client."""
        with self._lock:
            known = self.epoch
            if known is None:
                self.epoch = epoch
                return
        if known != epoch:
            raise self.refuse(f"'{self.key}' holds epoch {epoch}, this client attached to epoch {known}")

    def restored(self, epoch: str) -> None:
        """A checkpoint was loaded into the namespace, whose epoch is now ``epoch``: start afresh."""
        with self._lock:
            self.epoch = epoch
            self.lost = None
            self.lost_event.clear()

    def _unchecked(self) -> bool:
        # not learned yet (the first call learns it), or being taken up again by a checkpoint load
        return self.restoring or (self.epoch is None and self.lost is None)

    def verify(self, epoch: Any, where: str) -> None:
        """Compare ``epoch`` (what ``HGET <ns>:config epoch`` answered) with the one learned; a
        mismatch or a missing one marks the namespace lost (and raises)."""
        if self.epoch is None or self.lost is not None:
            self.check()
            return
        found = text(epoch)
        if found == self.epoch:
            return
        if found is None:
            raise self.refuse(f"'{self.key}' has no epoch any more ({where})")
        raise self.refuse(f"'{self.key}' holds epoch {found}, this client attached to epoch {self.epoch} ({where})")

    # -- the check of every new connection (connections.sync_client's / async_client's ``on_connect``) --

    def check_connection(self, connection: Any) -> None:
        """A new blocking connection, its handshake done: the epoch, before its first command."""
        if self._unchecked():
            return
        connection.send_command("HGET", self.key, FIELD)
        try:
            reply = connection.read_response()
        except redis.ResponseError:  # MOVED (another cluster node holds it), an ACL without it
            return
        try:
            self.verify(reply, "seen on a new connection")
        except ServerStateLost:
            connection.disconnect()  # redis-py keeps a connection whose hook failed otherwise
            raise

    async def check_connection_async(self, connection: Any) -> None:
        """:meth:`check_connection` for a ``redis.asyncio`` connection."""
        if self._unchecked():
            return
        await connection.send_command("HGET", self.key, FIELD)
        try:
            reply = await connection.read_response()
        except redis.ResponseError:
            return
        try:
            self.verify(reply, "seen on a new connection")
        except ServerStateLost:
            await connection.disconnect()
            raise
