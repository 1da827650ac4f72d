"""Which nodes hold each key of a replicated ring, once repairs have re-made the copies of dead nodes.

A replicated ring (``storage.replicas`` N > 1) places each key on its N holders
(:meth:`~tq_redis.backends.dram.placement.Ring.holders`). When one of those nodes dies, a repair
(:mod:`tq_redis.backends.dram.repair`) copies what it held to other nodes and records a
*generation*: ``(dead node id, ring)``, where ``ring`` is the set of live nodes the repair placed
the new copies on. Generations apply in order: a key one of whose holders is the dead node gets,
in that node's place, the best-scoring node of the generation's ring that does not hold it yet
(on a host of its own where one is left). Every process computes the same holders from the ring
id and the generations recorded in Redis (:func:`~tq_redis.meta.keys.storage_repairs_key`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tq_redis.backends.dram.placement import Ring, pick_distinct

__all__ = ["Generation", "holder_ids", "replacements"]

#: a repair of a ring: the node that died, and the ring of live nodes its copies were re-made on
Generation = tuple[str, Ring]


def holder_ids(ring: Ring, keys: Sequence[str], generations: Sequence[Generation] = ()) -> np.ndarray:
    """The node ids holding each key put under ``ring``, best first: shape ``(len(keys), replicas)``
    (an object array), after ``generations`` (in the order they were recorded)."""
    ids = np.array([lk.node_id for lk in ring.links], dtype=object)[ring.holders(keys)]
    for dead, fresh in generations:
        rows = np.flatnonzero((ids == dead).any(axis=1))
        if len(rows):
            ids[rows] = replacements(ids[rows], [keys[r] for r in rows.tolist()], dead, fresh)
    return ids


def replacements(held: np.ndarray, keys: Sequence[str], dead: str, fresh: Ring) -> np.ndarray:
    """``held`` (node ids per key, one of them ``dead``) with ``dead`` replaced by each key's best
    node of ``fresh`` that holds it not yet (its host not among the others' where possible)."""
    index = {lk.node_id: i for i, lk in enumerate(fresh.links)}
    taken = np.array([[index.get(n, -1) if n != dead else -1 for n in row] for row in held.tolist()], np.intp)
    taken = taken.reshape(held.shape)
    order = np.argsort(fresh.scores(keys), axis=1, kind="stable")[:, ::-1]
    new = pick_distinct(order, fresh.host_of, 1, taken)[:, 0]
    names = np.array([lk.node_id for lk in fresh.links], dtype=object)
    out = held.copy()
    col = (held == dead).argmax(axis=1)
    out[np.arange(len(held)), col] = names[new]
    return out
