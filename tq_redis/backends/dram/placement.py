"""Where the ``dram`` store puts a key: rendezvous (highest-random-weight) hashing over the live nodes.

Each key scores every node with a stable 64-bit hash of (key, node id); the highest score owns the
key. Adding a node moves only the keys it now wins (about 1/(n+1) of them), and a key's
second-ranked node is the one that held it while the first was out of the ring. Hashes are the
same in every process (``zlib.crc32`` and ``blake2b``, never Python's salted ``hash``).

A ring is named by :func:`ring_id` of its node ids, so any process can place a key under a ring it
never saw live, knowing only that name's members (the ``<ns>:storage:rings`` table in Redis): that
is how a value put before nodes joined or left is found where it was put.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from tq_redis.codec.batchscan import crc32_keys

__all__ = ["Member", "Ring", "group_by_node", "key_hashes", "ring_id"]


class _Member(Protocol):
    """What placement needs of a node: its stable id."""

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


def ring_id(node_ids: Sequence[str]) -> str:
    """The name of the ring of these node ids (any order): 16 hex digits, the same in every process."""
    joined = "\n".join(sorted(node_ids)).encode()
    return hashlib.blake2b(joined, digest_size=8).hexdigest()


class Member(NamedTuple):
    """A node of a recorded ring: its id and the address it had when the ring was recorded."""

    node_id: str
    address: str


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hashes of keys (identical in every process, unlike ``hash``)."""
    return _mix64(crc32_keys(keys))


class Ring(Generic[M]):
    """An immutable set of nodes (``links``, sorted by node id), for placement: the live nodes'
    links, or the :class:`Member` list of a ring recorded in Redis."""

    __slots__ = ("links", "seeds", "id")

    def __init__(self, links: list[M]) -> None:
        self.links = sorted(links, key=lambda lk: lk.node_id)
        self.seeds = np.array([_seed(lk.node_id) for lk in self.links], dtype=np.uint64)
        self.id = ring_id([lk.node_id for lk in self.links])

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
