"""Where the ``dram`` store puts a key: rendezvous (highest-random-weight) hashing over the live nodes.

Each key scores every node with a stable 64-bit hash of (key, node id); the highest score owns the
key. Adding a node moves only the keys it now wins (about 1/(n+1) of them), and a key's
second-ranked node is the one that held it while the first was out of the ring. Hashes are the
same in every process (``zlib.crc32`` and ``blake2b``, never Python's salted ``hash``).

A ring is named by :func:`ring_id` of its node ids, so any process can place a key under a ring it
never saw live, knowing only that name's members (the ``<ns>:storage:rings`` table in Redis): that
is how a value put before nodes joined or left is found where it was put.

With ``storage.replicas: N`` (N > 1) a key is held by its N best-scoring nodes, on distinct hosts
where the ring knows N hosts (:meth:`Ring.holders`); such a ring's id carries the count
(``<16 hex>r<N>``, :func:`replicas_of`) and its recorded members carry their hosts, so every
process computes the same holders from the id alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from tq_redis.codec.batchscan import crc32_keys

__all__ = ["Member", "Ring", "group_by_holders", "group_by_node", "key_hashes", "replicas_of", "ring_id"]


class _Member(Protocol):
    """What placement needs of a node: its stable id (and, where known, a ``host`` attribute)."""

    node_id: str


M = TypeVar("M", bound=_Member)


_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mixer (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _C1
    x = x ^ (x >> np.uint64(27))
    x = x * _C2
    return x ^ (x >> np.uint64(31))


def _seed(node_id: str) -> int:
    """A node's stable 64-bit seed, from its id."""
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "little")


def ring_id(node_ids: Sequence[str], replicas: int = 1) -> str:
    """The name of the ring of these node ids (any order): 16 hex digits, the same in every process,
    followed by ``r<N>`` for a ring that places every key on ``replicas`` = N > 1 nodes."""
    joined = "\n".join(sorted(node_ids)).encode()
    name = hashlib.blake2b(joined, digest_size=8).hexdigest()
    return name if replicas == 1 else f"{name}r{replicas}"


def replicas_of(ring: str) -> int:
    """How many nodes hold each key put under the ring named ``ring`` (see :func:`ring_id`)."""
    tail = ring[16:]
    if tail.startswith("r") and tail[1:].isdigit():
        return int(tail[1:])
    return 1


class Member(NamedTuple):
    """A node of a recorded ring: its id, the address it had when the ring was recorded, and its
    host (recorded for rings of replicated puts; "" otherwise)."""

    node_id: str
    address: str
    host: str = ""


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hashes of keys (identical in every process, unlike ``hash``)."""
    return _mix64(crc32_keys(keys))


class Ring(Generic[M]):
    """An immutable set of nodes (``links``, sorted by node id), for placement: the live nodes'
    links, or the :class:`Member` list of a ring recorded in Redis."""

    __slots__ = ("links", "seeds", "id", "replicas", "host_of")

    def __init__(self, links: list[M], replicas: int = 1) -> None:
        self.links = sorted(links, key=lambda lk: lk.node_id)
        self.seeds = np.array([_seed(lk.node_id) for lk in self.links], dtype=np.uint64)
        self.replicas = replicas
        self.id = ring_id([lk.node_id for lk in self.links], replicas)
        # each node's host as a small integer (an unknown host counts as a host of its own)
        hosts: dict[str, int] = {}
        names = [getattr(lk, "host", "") or f"?{lk.node_id}" for lk in self.links]
        self.host_of = np.array([hosts.setdefault(h, len(hosts)) for h in names], dtype=np.intp)

    def scores(self, keys: Sequence[str]) -> np.ndarray:
        """Each key's score on each node, shape ``(len(keys), len(links))``."""
        h = key_hashes(keys)
        return _mix64(h[:, None] ^ self.seeds[None, :])

    def owners(self, keys: Sequence[str]) -> np.ndarray:
        """Index (into ``links``) of each key's node: the highest-scoring one."""
        if len(self.links) == 1:
            return np.zeros(len(keys), dtype=np.intp)
        return np.argmax(self.scores(keys), axis=1)

    def ranked(self, keys: Sequence[str], depth: int = 2) -> np.ndarray:
        """The ``depth`` best nodes of each key, best first (shape ``(len(keys), depth)``)."""
        order = np.argsort(self.scores(keys), axis=1)[:, ::-1]
        return order[:, : min(depth, len(self.links))]

    def holders(self, keys: Sequence[str]) -> np.ndarray:
        """The ``replicas`` nodes holding each key, best first (shape ``(len(keys), replicas)``).

        Each next holder is the best-scoring node not chosen yet on a host not chosen yet; when
        the ring has fewer hosts than ``replicas``, the rest are the best nodes not chosen yet.
        With ``replicas`` = 1 this is :meth:`owners`.
        """
        if self.replicas == 1:
            return self.owners(keys)[:, None]
        n = len(self.links)
        if n < self.replicas:
            raise ValueError(f"a ring of {n} node(s) cannot hold {self.replicas} replicas")
        order = np.argsort(self.scores(keys), axis=1, kind="stable")[:, ::-1]
        return pick_distinct(order, self.host_of, self.replicas)


def pick_distinct(order: np.ndarray, host_of: np.ndarray, count: int, taken: np.ndarray | None = None) -> np.ndarray:
    """``count`` nodes per row of ``order`` (node indexes, best first): each the first not taken
    on a host not taken yet, or failing that the first not taken. ``taken``: nodes (indexes, one
    row per row of ``order``, -1 for none) already chosen, which are skipped and whose hosts count."""
    rows = np.arange(len(order))
    n_hosts = int(host_of.max()) + 1 if len(host_of) else 0
    chosen = np.zeros(order.shape, bool)  # in order's positions
    used_host = np.zeros((len(order), n_hosts), bool)
    node_pos = np.argsort(order, axis=1)  # node index -> its position in the row's order
    if taken is not None:
        for col in range(taken.shape[1]):
            have = taken[:, col] >= 0
            chosen[rows[have], node_pos[rows[have], taken[have, col]]] = True
            used_host[rows[have], host_of[taken[have, col]]] = True
    out = np.empty((len(order), count), np.intp)
    hosts_in_order = host_of[order]
    for col in range(count):
        free = ~chosen & ~used_host[rows[:, None], hosts_in_order]
        fallback = ~chosen
        pos = np.where(free.any(axis=1), free.argmax(axis=1), fallback.argmax(axis=1))
        out[:, col] = order[rows, pos]
        chosen[rows, pos] = True
        used_host[rows, hosts_in_order[rows, pos]] = True
    return out


def group_by_holders(holders: np.ndarray, n_nodes: int) -> list[tuple[int, np.ndarray]]:
    """(node index, positions of the keys it holds) for every node holding at least one key,
    from a ``(keys, replicas)`` holders table (a key appears under each of its holders)."""
    if holders.shape[1] == 1:
        return group_by_node(holders[:, 0], n_nodes)
    out = []
    for node in np.unique(holders).tolist():
        out.append((node, np.flatnonzero((holders == node).any(axis=1))))
    return out


def group_by_node(owner: np.ndarray, n_nodes: int) -> list[tuple[int, np.ndarray]]:
    """(node index, positions of its keys) for every node that owns at least one key."""
    if n_nodes == 1:
        return [(0, np.arange(len(owner)))]
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=n_nodes)
    out, start = [], 0
    for node, c in enumerate(counts):
        if c:
            out.append((node, order[start : start + c]))
            start += c
    return out
