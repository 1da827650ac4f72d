"""MindSpeed-RL's partial rollout (``max_age > 1``) for :class:`~tq_redis.dock.dock.GRPOTransferDock`.

A rollout may stop before its response is finished; the dock then hands the row back to
``actor_rollout`` to continue, and the row ages by one each step (each ``clear``) it survives.
The per-row state lives in Redis beside the dock's partition, indexed by row number:

* ``<ns>:{dock.<name>}:dockdone`` (bitmap): the row's rollout is finished (MindSpeed's
  ``rollout_completed``), set by a put of ``responses`` whose ``rollout_completed`` is 1;
* ``...:dockready`` (bitmap): the row belongs to a prompt whose rollouts are all finished, as of
  the last ``get_update_ready`` / ``all_consumed("actor_rollout")`` (MindSpeed's
  ``global_ready_mask``); consumers other than ``actor_rollout`` claim only these rows;
* ``...:dockage`` (HASH row -> age, absent: 0): steps the row has waited (MindSpeed's ``age``).

``clear(consumer)`` drops only the rows ``consumer`` consumed, ages the rest (those holding
``input_ids``) and re-sorts whole prompts oldest first. The re-sort moves no bytes: it remaps which
sample each row's key names (``kv`` / ``kvkeys`` and the ``uid`` / ``dock_index`` tags), and the
bitmaps and ages above are permuted with it. A clear runs while no other process uses the dock,
as in MindSpeed (the trainer clears between steps).

Every change of this state is one script of the library, so the partition's tag-change stream
(``kv_watch``), its events and the rate limiter see it as they see any other client's:
``lua/dock_finish.lua`` (a put of responses: finished rows recorded, unfinished ones handed back to
``actor_rollout``), ``lua/unproduce.lua`` (a rollout claim: the response is unwritten again),
``lua/dock_ready.lua`` (the ready mask) and ``lua/dock_resort.lua`` (the clear's re-sort, which
kv_watch reports as a tag change of every moved row). This module only reads state and computes
MindSpeed's order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tq_redis import ops
from tq_redis.meta import bitmaps
from tq_redis.ops import kv, transitions
from tq_redis.ops.effects import Cmd, Pipe

Op = ops.Op

PAD_INDEX = -2  # MindSpeed's index of a row added to reach a multiple of dp_size
RESET_ON_CLAIM = ("responses", "response_length")  # columns a rollout claim marks unwritten again
ROLLOUT_CONSUMER = "actor_rollout"  # the consumer that continues unfinished rollouts


def bits(raw: bytes | None, length: int) -> np.ndarray:
    """A bitmap as a 0/1 int32 array of ``length`` positions."""
    out = np.zeros(length, dtype=np.int32)
    got = bitmaps.unpack(raw)[:length]
    out[: len(got)] = got
    return out


def group_sort(age: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """MindSpeed's re-sort: every row takes its prompt's highest age, and prompts are ordered by
    that age, highest first (ties keep their order). Returns ``(row order, ages in that order)``."""
    group_age = age.reshape(-1, n).max(axis=1)
    groups = sorted(range(len(group_age)), key=lambda g: -int(group_age[g]))
    order = np.array([g * n + j for g in groups for j in range(n)], dtype=np.int64)
    return order, np.repeat(group_age[groups], n)


class PartialRollout:
    """The partial-rollout state of one dock (see the module docstring); ``dock`` is its owner."""

    def __init__(self, dock: Any, max_age: int, gbs_train: int) -> None:
        self.dock = dock
        self.max_age = max_age
        self.gbs_train = gbs_train
        pk = dock._pk
        self.done_key, self.ready_key, self.age_key = pk.dockdone, pk.dockready, pk.dockage

    # -- reading state ------------------------------------------------------------------------

    def state(self) -> Op:
        """``(done, ready, age)`` over the dock's rows, as int arrays."""
        length = self.dock.max_len
        done, ready, ages = yield Pipe((
            Cmd(("GET", self.done_key)), Cmd(("GET", self.ready_key)), Cmd(("HGETALL", self.age_key)),
        ))
        age = np.zeros(length, dtype=np.int64)
        items = ages.items() if isinstance(ages, dict) else zip(ages[::2], ages[1::2])
        for row, value in items:
            age[int(row)] = int(value)
        return bits(done, length), bits(ready, length), age

    def ages(self, rows: Sequence[int]) -> Op:
        got = yield Cmd(("HMGET", self.age_key, *[str(r) for r in rows]))
        return [0 if v is None else int(v) for v in got]

    def done_groups(self) -> Op:
        """Refresh the ready mask from the finished rollouts; returns the number of finished prompts."""
        dock = self.dock
        return (yield from transitions.dock_ready(dock._pk, dock.n_samples_per_prompt, dock.max_len).call())

    def update_ready(self, require_max_age_all_finished: bool) -> Op:
        finished = yield from self.done_groups()
        ready = finished >= self.gbs_train
        if require_max_age_all_finished:
            done, _, age = yield from self.state()
            ready = ready and bool(done[age == self.max_age - 1].all())
        return ready

    # -- put ----------------------------------------------------------------------------------

    def after_responses(self, rows: list[int], completed: list[bool]) -> Op:
        """Record finished rollouts and hand unfinished rows back to ``actor_rollout``."""
        yield from transitions.dock_finish(self.dock._pk, ROLLOUT_CONSUMER, rows, completed).call()

    # -- claims -------------------------------------------------------------------------------

    def chooser(self, count: int, rollout: bool, grouped: bool):
        """A :data:`~tq_redis.ops.claim.Chooser` taking ready rows in row order: for ``actor_rollout``
        the first ``count`` (or all, if fewer); for other consumers only rows of the ready mask,
        whole prompts when ``grouped``, and nothing unless ``count`` rows qualify."""
        n = self.dock.n_samples_per_prompt
        pk = self.dock._pk

        def choose(ready: list[int]) -> Op:
            tags = yield Cmd(("HMGET", pk.tag("dock_index"), *ready))
            by_row = sorted((int(json.loads(t)), sid) for sid, t in zip(ready, tags) if t is not None)
            if not rollout:
                mask = bits((yield Cmd(("GET", self.ready_key))), self.dock.max_len)
                by_row = [(r, s) for r, s in by_row if mask[r]]
                if grouped:
                    members: dict[int, list[int]] = {}
                    for r, s in by_row:
                        members.setdefault(r // n, []).append(s)
                    by_row = [(g * n, s) for g, sids in sorted(members.items()) if len(sids) == n for s in sids]
                if len(by_row) < count:
                    return None
            ids = [s for _, s in by_row[:count]]
            return ids, ids

        return choose

    def after_rollout_claim(self, sids: list[int]) -> Op:
        """A claimed rollout is being continued: its response is unwritten again (MindSpeed)."""
        if sids:
            yield from transitions.unproduce(self.dock._pk, sids, RESET_ON_CLAIM).call()

    # -- clear --------------------------------------------------------------------------------

    def clear(self, consumer: str) -> Op:
        """Drop the rows ``consumer`` consumed, age the rest and re-sort prompts oldest first."""
        dock, pk = self.dock, self.dock._pk
        consumed, has_input = yield from dock._row_status([pk.cons(consumer), pk.prod("input_ids")])
        gone = np.flatnonzero(consumed.numpy())
        if not len(gone):
            return
        yield from kv.clear(dock._ctx, [str(r) for r in gone], dock.partition_id)
        done, ready, age = yield from self.state()
        age = age + has_input.numpy()
        age[gone], done[gone], ready[gone] = -1, 0, 0
        order, age = group_sort(age, dock.n_samples_per_prompt)
        age[age < 0] = 0
        yield from transitions.dock_resort(
            pk, dock.n_samples_per_prompt, order.tolist(), done[order].tolist(), ready[order].tolist(), age.tolist()
        ).call()


def age_column(ages: list[int]) -> torch.Tensor:
    """The ``age`` column a rollout claim adds (one ``[age]`` row per claimed row, int32 as MindSpeed)."""
    return torch.tensor(ages, dtype=torch.int32).unsqueeze(1)
