"""Learning a namespace's identity before a client's first call, and taking it up again after a
checkpoint was loaded (see :mod:`tq_redis.server.identity` for why and what is checked).

:func:`learn` reads ``<ns>:config``'s ``epoch`` with its mirror, the storage-node registry and
Redis's clock in one round trip. An epoch there is the namespace's. None there is a namespace never
created -- unless live storage nodes (or the mirror) still carry an epoch: then its state was lost
and the client raises :class:`~tq_redis.errors.ServerStateLost` instead of starting it afresh.
Otherwise the client draws one (``HSETNX``: of two first clients one wins and both read it back).
A namespace with storage nodes (some registered, or the ``dram`` store) gets the copy its nodes read,
``<ns>:storage:epoch``; others have no use for it.
"""

from __future__ import annotations

import json
from typing import Any

from tq_redis.meta.keys import storage_nodes_key
from tq_redis.ops.context import Op
from tq_redis.ops.effects import Cmd, Pipe
from tq_redis.server.identity import FIELD, Identity, foreign_nodes, new_epoch, text

__all__ = ["learn", "learned_first", "restore"]


def _now_s(reply: Any) -> float:
    sec, usec = reply
    return int(sec) + int(usec) / 1e6


def _serves_nodes(spec: Any, nodes: Any) -> bool:
    """Whether the namespace has storage nodes to tell its epoch (``<ns>:storage:epoch``): some are
    registered, or its store is the ``dram`` one (its nodes may register later)."""
    if nodes:
        return True
    try:
        return json.loads(spec).get("backend") == "dram"
    except (TypeError, ValueError, AttributeError):
        return False


def _founded(ident: Identity) -> Op[str]:
    """Draw the namespace's epoch unless another client just did; the one it has now."""
    _, epoch = yield Pipe((Cmd(("HSETNX", ident.key, FIELD, new_epoch())), Cmd(("HGET", ident.key, FIELD))))
    return text(epoch) or ""


def learn(ident: Identity) -> Op[None]:
    """The namespace's epoch into ``ident`` (drawn if the namespace is new); raises
    ``ServerStateLost`` if the namespace's state is gone while its storage nodes remember it."""
    epoch, spec, mirror, nodes, now = yield Pipe((
        Cmd(("HGET", ident.key, FIELD)), Cmd(("HGET", ident.key, "storage")), Cmd(("GET", ident.mirror_key)),
        Cmd(("HGETALL", storage_nodes_key(ident.namespace))), Cmd(("TIME",)),
    ))  # fmt: skip
    epoch, mirror = text(epoch), text(mirror)
    if epoch is None:
        remembered = foreign_nodes(nodes or {}, _now_s(now), None)
        if remembered:
            named = ", ".join(f"{node} (epoch {e})" for node, e in sorted(remembered.items())[:4])
            raise ident.refuse(f"'{ident.key}' has no epoch but storage node(s) {named} still serve the "
                               f"namespace's values from before")
        if mirror is not None:
            raise ident.refuse(f"'{ident.key}' has no epoch but '{ident.mirror_key}' remembers epoch {mirror}")
        epoch = yield from _founded(ident)
    if mirror != epoch and (mirror is not None or _serves_nodes(spec, nodes)):
        yield Cmd(("SET", ident.mirror_key, epoch))
    ident.adopt(epoch)


def learned_first(ident: Identity, op: Op[Any]) -> Op[Any]:
    """``op``, with :func:`learn` run just before its first effect: an operation refused before it
    reaches Redis (a bad argument) learns nothing and writes nothing, not even the epoch."""
    try:
        effect = op.send(None)
    except StopIteration as stop:
        return stop.value
    if ident.epoch is None:
        yield from learn(ident)
    while True:
        try:
            value = yield effect
        except Exception as exc:  # the effect's error, handed to the operation, which decides
            try:
                effect = op.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                effect = op.send(value)
            except StopIteration as stop:
                return stop.value


def restore(ident: Identity) -> Op[str]:
    """Before a checkpoint load: keep the namespace's epoch if it has one, else draw one; ``ident``
    adopts it and refuses nothing any more. Returns the epoch."""
    ident.restoring = True
    try:
        epoch, spec, mirror, nodes = yield Pipe((
            Cmd(("HGET", ident.key, FIELD)), Cmd(("HGET", ident.key, "storage")), Cmd(("GET", ident.mirror_key)),
            Cmd(("HLEN", storage_nodes_key(ident.namespace))),
        ))  # fmt: skip
        epoch, mirror = text(epoch), text(mirror)
        if epoch is None:
            epoch = yield from _founded(ident)
        if mirror != epoch and (mirror is not None or _serves_nodes(spec, nodes)):
            yield Cmd(("SET", ident.mirror_key, epoch))
        ident.restored(epoch)
    finally:
        ident.restoring = False
    return epoch
