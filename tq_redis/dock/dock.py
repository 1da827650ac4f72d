"""``GRPOTransferDock``: MindSpeed-RL's experience dock, with its state in Redis instead of a Ray actor.

The signatures, defaults and results are MindSpeed-RL's (``mindspeed_rl/trainer/utils/transfer_dock.py``):
``GRPOTransferDock(prompts_num, n_samples_per_prompt, metrics=None, max_age=1, GBS_train=0,
addition_columns=None, addition_consumers=None, timeout=None, timeout_interval=None)``, then ours,
keyword-only: ``redis_url=``, ``namespace=``, ``name=``, ``layout=``. So ``ray.remote(GRPOTransferDock)``
is a drop-in for MindSpeed's actor class (the actor finds Redis through ``redis_url=`` or the
``TQ_REDIS_URL`` / ``TQ_NAMESPACE`` environment, e.g. Ray's ``runtime_env={"env_vars": ...}``).

Layout. A dock is one partition (``dock.<name>``) of ``prompts_num * n_samples_per_prompt`` rows.
Row ``i`` is the KV key ``str(i)`` (see :mod:`tq_redis.ops.kv`), tagged ``uid = i // n`` (its prompt)
and ``dock_index = i``; columns are fields and consumers are tasks. Beside the partition's own
keys a dock uses ``<ns>:{dock.<name>}:dock`` (HASH: its ``prompts_num`` and
``n_samples_per_prompt``, kept across clears), ``...:dockstate`` (HASH: ``cur_index``, the cursor
of ``prefetch_request_index``) and ``...:dockmetrics`` (LIST: one entry per ``update_metrics``
call, replayed in order by ``get_metrics``; an append is atomic, so concurrent updates are never
lost). ``clear`` deletes all but the first. Every change of the dock's state is one script of the
function library, as every other client's is, so the partition's event stream, ``kv_watch`` (its
tag-change stream), the consumers' rate limiters and their counts see the dock's too: claims
(``lua/claim.lua``, ``lua/claim_ids.lua``), reads by index (``lua/mark_consumed.lua``), the shape,
cursors and metric log (``lua/dock_shape.lua``, ``lua/dock_cursor.lua``, ``lua/dock_metric.lua``,
``lua/dock_reset.lua``) and partial rollout's (:mod:`tq_redis.dock.aging`). Any number of processes
may build the same dock (same ``name=``) or receive it pickled (it pickles to its address); every
claim is one atomic script:

* ``get_experience`` without ``indexes`` claims ``experience_count`` ready rows the consumer has
  not consumed: whole prompts (``GRPOGroupNSampler`` over the ``uid`` tag) with ``get_n_samples``
  (the default, as in MindSpeed), else single rows (``SequentialSampler``); ``(None, None)`` when
  too few are ready. With ``get_n_samples`` and ``GBS_train > 0`` a consumer that has consumed
  ``GBS_train * n_samples_per_prompt`` rows gets ``(None, None)``, as in MindSpeed (the count is
  read just before the claim, so concurrent claimers may each take one batch past it, as a
  sequential MindSpeed caller can).
* ``use_batch_seqlen_balance`` (for the consumers of ``batch_seqlen_balance_mapper``, as in
  MindSpeed) chooses in the client: the ready rows (or whole prompts) are split into
  ``ready // experience_count`` parts of equal size balanced by ``prompt_length + response_length``
  (Karmarkar-Karp) and the first part is claimed only if all of it is still free
  (``lua/claim_ids.lua``; retried on conflict).
* ``get_experience`` with ``indexes`` marks them consumed and waits (on the partition's event
  stream, not by sleeping) until their columns are put, logging a warning once ``timeout`` seconds
  have passed and every ``timeout_interval`` seconds after, as MindSpeed does.
* The result is MindSpeed's: a ``TensorDict`` (built by ``TensorDict.from_dict``) whose columns are
  zero-padded along each row's first dimension, plus ``original_length`` (every row's length,
  column after column), so ``remove_padding_tensor_dict_to_dict`` and friends work on it; and
  ``put_experience`` strips that padding again when ``original_length`` is given.
  ``layout="jagged"`` returns jagged nested tensors instead (no padding, no ``original_length``).

Differences from MindSpeed-RL on purpose (MindSpeed's behaviour would lose data or hide an error,
or the difference only adds to what it accepts):

* Construction makes a new, empty dock (as a new MindSpeed actor is) unless ``name=`` names one
  to attach to; a name already used with another ``prompts_num`` / ``n_samples_per_prompt``
  raises :class:`~tq_redis.errors.InvalidArgument` instead of mixing two docks' rows.
* ``max_age > 1`` is MindSpeed's partial rollout (re-queued rollouts, ages, rows re-sorted
  oldest first by ``clear``), kept in :mod:`tq_redis.dock.aging`; its differences: it needs
  ``GBS_train > 0`` at construction (MindSpeed: at the first put), consumers other than
  ``actor_rollout`` take ready rows in row order (no random draw, no seqlen balance), and the -2
  rows a rollout claim pads with are skipped when put back (MindSpeed writes them into the
  second-to-last row). ``allow_partial_ready_data`` is accepted and, as in MindSpeed's current
  source, does nothing; ``dp_size`` only pads rollout claims under partial rollout.
* ``GBS_train=0`` (MindSpeed's default) means "no cap"; in MindSpeed it makes every
  ``get_n_samples`` claim return ``(None, None)``, so an ``all_consumed`` loop never ends.
* Columns keep their dtype (MindSpeed turns int64 into int32, which corrupts values >= 2**31).
  A column of scalar rows comes back as a 1-D tensor with ``original_length`` 1 per row
  (MindSpeed cannot return scalar rows at all).
* Rows are claimed in the order they were first written (oldest first) instead of at random:
  every choice MindSpeed's uniform draw could make is still possible, and the order is
  reproducible.
* Bad input raises a typed error from :mod:`tq_redis.errors` (a ``ValueError`` subclass where
  MindSpeed raises ``ValueError``): an unknown consumer or column, an index outside the dock or
  negative (MindSpeed reads row ``-2`` as the second-to-last row and skips negative rows on put),
  the same row twice in one put (MindSpeed keeps the last silently), an ``original_length`` that
  does not match the columns, a balanced claim whose rows lack ``prompt_length`` /
  ``response_length``. ``clear`` works without ``metrics`` (MindSpeed raises ``AttributeError``).
* ``get_metrics`` returns a fresh copy of the ``metrics`` object given (one of this module's
  :class:`DockMetrics` when none was) holding every update since the last ``clear``, applied with
  the object's own ``update``; the dock's metrics start empty. Any object is taken as
  ``metrics``, as in MindSpeed; only ``update_metrics`` needs its ``update``. An update the object
  rejects (or lacks ``update`` for, or an object that cannot be copied) raises
  :class:`~tq_redis.errors.InvalidArgument` and is not recorded.
* Additions: ``put_experience`` returns the rows written, may omit ``indexes`` (rows are then
  appended after the last ones handed out) and takes ``repeat_prompts=True`` (each row is a
  prompt stored in its ``n_samples_per_prompt`` rows; ``indexes`` then name prompts);
  ``get_experience`` takes ``timeout=`` (None: claims return at once and reads by index wait as
  long as it takes, as in MindSpeed) and ``layout=``. ``get_update_ready`` and
  ``get_incomplete_response_num`` with ``max_age=1`` count a row's rollout complete once its
  ``responses`` are put (a rollout is never continued; MindSpeed only tracks completion under
  partial rollout and returns constants otherwise).

This module holds ``GRPOTransferDock`` (consumers, claims, metrics, request indexes) and is where
to import the dock from; its parts: :mod:`tq_redis.dock.base` (the base class ``TransferDock``:
shape, rows written and read by index, status), :mod:`tq_redis.dock.layout` (the padded layout
and back) and :mod:`tq_redis.dock.metrics` (``DockMetrics`` and the log of updates).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import numpy as np
import torch
from tensordict import TensorDict

from tq_redis import ops
from tq_redis.dock.aging import PAD_INDEX, PartialRollout, age_column
from tq_redis.dock.base import DEFAULT_TIMEOUT_INTERVAL_S as DEFAULT_TIMEOUT_INTERVAL_S
from tq_redis.dock.base import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from tq_redis.dock.base import WAIT_SLICE_S, DockPlace, TransferDock, extend_names, int_at_least
from tq_redis.dock.layout import LAYOUTS as LAYOUTS
from tq_redis.dock.layout import ORIGINAL_LENGTH as ORIGINAL_LENGTH
from tq_redis.dock.layout import as_layout, check_layout, unpadded
from tq_redis.dock.metrics import DockMetrics as DockMetrics
from tq_redis.dock.metrics import encode_update, replay
from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.meta import BatchMeta
from tq_redis.meta.schemas import to_batchmeta_schema
from tq_redis.ops import streaming, transitions
from tq_redis.ops.effects import Cmd, Wait
from tq_redis.samplers import karmarkar_karp

Op = ops.Op

EXPERIENCE_COLUMNS = (
    "prompts", "prompt_length", "responses", "response_length", "attention_mask", "labels", "input_ids",
    "input_ids_length", "actor_rollout", "rm_scores", "token_level_rewards", "old_log_prob", "ref_log_prob",
    "advantages", "returns",
)
EXPERIENCE_CONSUMERS = (
    "trainer", "actor_rollout", "actor_image_embeds", "actor_log_prob", "ref_log_prob", "actor_train",
    "compute_advantage", "rule_reward", "reward_scores", "grpo_metrics",
)
SEQLEN_COLUMNS = ("prompt_length", "response_length")
SEQLEN_BALANCE_CONSUMERS = ("ref_log_prob", "actor_log_prob", "reward_scores", "actor_train")
_CLAIM_RETRIES = 16


# ------------------------------------------------------------------ MindSpeed's GRPO dock


class GRPOTransferDock(TransferDock):
    """The experience dock of a GRPO step, with MindSpeed-RL's ``GRPOTransferDock`` API.

    Args:
        prompts_num: prompts per step; the dock has ``prompts_num * n_samples_per_prompt`` rows.
        n_samples_per_prompt: responses per prompt (rows ``[p*n, (p+1)*n)`` belong to prompt p).
        metrics: any object, as MindSpeed accepts; ``update_metrics`` calls its
            ``update(key, value, cumulate=)`` (MindSpeed's ``Metric``), so only an object used for
            updates needs one, and ``get_metrics`` returns copies of it. None: a :class:`DockMetrics`.
        max_age: 1, or > 1 for MindSpeed's partial rollout (see :mod:`tq_redis.dock.aging` and
            the dock's docs page): unfinished rollouts are re-queued and age, and a row of age
            ``max_age - 1`` must finish before ``get_update_ready``.
        GBS_train: with ``get_n_samples``, a consumer gets nothing more once it has consumed
            ``GBS_train * n_samples_per_prompt`` rows; 0: no cap.
        addition_columns / addition_consumers: names beyond MindSpeed-RL's defaults.
        timeout / timeout_interval: a read by index logs a warning after ``timeout`` seconds
            (None: 300) and then every ``timeout_interval`` seconds (None: 5).
        The keyword-only ``**place`` (:class:`~tq_redis.dock.base.DockPlace`):
        redis_url / namespace: where the dock lives (default: ``tq_redis.init()``'s, or
            ``TQ_REDIS_URL`` / ``TQ_NAMESPACE``).
        name: the dock to attach to (processes sharing a dock pass the same name, or pickle
            it); None makes a new, empty dock, as constructing MindSpeed's actor does.
        layout: ``"padded"`` (default, MindSpeed's: zero-padded columns plus ``original_length``)
            or ``"jagged"`` (nested tensors); ``get_experience(layout=)`` overrides it.
    """

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int,
        metrics: Any = None,
        max_age: int = 1,
        GBS_train: int = 0,  # noqa: N803 - MindSpeed-RL's keyword
        addition_columns: Sequence[str] | None = None,
        addition_consumers: Sequence[str] | None = None,
        timeout: float | None = None,
        timeout_interval: float | None = None,
        **place: Unpack[DockPlace],
    ) -> None:
        self.max_age = int_at_least("max_age", max_age, 1)
        self.GBS_train = int_at_least("GBS_train", GBS_train, 0)
        self.enable_partial_rollout = self.max_age > 1
        if self.enable_partial_rollout and not self.GBS_train:
            raise InvalidArgument(
                f"max_age={max_age} (partial rollout) needs GBS_train > 0: the prompts a training step takes"
            )
        self.metrics = metrics
        self.experience_consumers = extend_names(EXPERIENCE_CONSUMERS, addition_consumers)
        self.batch_seqlen_balance_mapper = {c: list(SEQLEN_COLUMNS) for c in SEQLEN_BALANCE_CONSUMERS}
        super().__init__(
            prompts_num, n_samples_per_prompt, extend_names(EXPERIENCE_COLUMNS, addition_columns), timeout,
            timeout_interval, **place,
        )
        self._partial = PartialRollout(self, self.max_age, self.GBS_train) if self.enable_partial_rollout else None
        self._spec = (
            (prompts_num, n_samples_per_prompt, metrics, max_age, GBS_train, addition_columns, addition_consumers,
             timeout, timeout_interval),
            self._where(),
        )

    def _check_consumer(self, consumer: str) -> str:
        if consumer not in self.experience_consumers:
            raise InvalidArgument(
                f"consumer {consumer!r} is not one of {self.experience_consumers}; add it with addition_consumers="
            )
        return consumer

    # -- metrics -----------------------------------------------------------------------------

    def update_metrics(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        """Record ``metrics.update(key, value, cumulate=cumulate)`` for every process of the dock."""
        entry = encode_update(self.metrics, key, value, cumulate, allow_pickle=self._ctx.allow_pickle)
        self._run(transitions.dock_metric(self._pk, entry).call())

    def get_metrics(self) -> Any:
        """A copy of the ``metrics`` object holding every update since the last ``clear``."""
        return replay(self.metrics, self._cmd("LRANGE", self._metrics_key, 0, -1), allow_pickle=self._ctx.allow_pickle)

    # -- request indexes ---------------------------------------------------------------------

    def get_cur_index(self) -> int:
        """How many rows ``prefetch_request_index`` has handed out since the last ``clear``."""
        value = self._cmd("HGET", self._state_key, "cur_index")
        return int(value) if value is not None else 0

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """The next ``experience_num`` row numbers (fewer at the end of the dock); None once all are given."""
        num = int_at_least("experience_num", experience_num, 0)
        # as MindSpeed: no move past the end
        first = self._run(transitions.dock_cursor(self._pk, "requests", num, self.max_len).call())
        if first is None:
            return None
        return list(range(first, min(first + num, self.max_len)))

    # -- put ---------------------------------------------------------------------------------

    def put_experience(
        self,
        data_dict: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        is_prompt: bool = False,
        *,
        repeat_prompts: bool = False,
    ) -> list[int]:
        """Write columns of rows; returns the row indexes written.

        ``data_dict`` maps column -> a tensor with one row per index, or a list of per-row tensors
        (lengths may differ); a ``TensorDict`` with ``original_length`` (what ``get_experience``
        and ``padding_dict_to_tensor_dict`` return) is cut back to the rows' lengths first.
        ``is_prompt`` marks MindSpeed's prompt put (with partial rollout it also writes placeholder
        ``responses`` / ``response_length``; a put of ``responses`` then needs ``rollout_completed``,
        and rows of index -2 are dropped). Ours:
        ``indexes`` may be left out (the rows after the last ones handed out are used), and with
        ``repeat_prompts`` every row is a prompt, stored in its ``n_samples_per_prompt`` rows, and
        ``indexes`` (if given) are prompt numbers.
        """
        columns = unpadded(data_dict)
        completed = self._rollout_completed(columns)
        self._check_columns(list(columns))
        if not columns:
            raise InvalidArgument("put_experience: data_dict has no column")
        counts = {c: len(r) for c, r in columns.items()}
        rows = next(iter(counts.values()))
        if set(counts.values()) != {rows} or rows == 0:
            raise BatchSizeMismatch(f"put_experience: every column needs the same (non-zero) row count, got {counts}")
        if completed is not None and len(completed) != rows:
            raise BatchSizeMismatch(f"put_experience: {rows} rows but {len(completed)} rollout_completed flags")
        n = self.n_samples_per_prompt if repeat_prompts else 1
        if repeat_prompts:
            columns = {c: [r for r in values for _ in range(n)] for c, values in columns.items()}
            completed = completed and [c for c in completed for _ in range(n)]
        if self._partial is not None and is_prompt:  # MindSpeed's placeholder responses
            for column, value, like in (("responses", -1, "prompts"), ("response_length", 0, "prompt_length")):
                first = columns[like][0] if like in columns else None
                dtype = first.dtype if isinstance(first, torch.Tensor) else torch.int32  # one dtype per column
                columns.setdefault(column, [torch.tensor([value], dtype=dtype)] * (rows * n))
        if indexes is None:
            first = self._run(transitions.dock_cursor(self._pk, "rows", rows * n).call())
            if first % n:
                raise InvalidArgument(
                    f"put_experience(repeat_prompts=True) without indexes needs the dock's next free row ({first}) "
                    f"to start a prompt; pass indexes="
                )
            rows_at = list(range(first, first + rows * n))
        else:
            if len(indexes) != rows:
                raise BatchSizeMismatch(f"put_experience: {rows} rows but {len(indexes)} indexes")
            rows_at = [int(p) * n + j for p in indexes for j in range(n)] if repeat_prompts else list(indexes)
        if self._partial is not None and not repeat_prompts:  # rows a rollout claim padded with: not rows
            keep = [k for k, i in enumerate(rows_at) if not (isinstance(i, int | np.integer) and i == PAD_INDEX)]
            if not keep:
                return []
            rows_at = [rows_at[k] for k in keep]
            columns = {c: [values[k] for k in keep] for c, values in columns.items()}
            completed = completed and [completed[k] for k in keep]
        rows_at = self._check_indexes(rows_at)
        self._write(columns, rows_at)
        if completed:
            self._run(self._partial.after_responses(rows_at, completed))
        return rows_at

    def _rollout_completed(self, columns: dict[str, list[Any]]) -> list[bool] | None:
        """Pops MindSpeed's ``rollout_completed`` (one flag per row) from a put of ``responses``."""
        if self._partial is None:
            return None
        flags = columns.pop("rollout_completed", None)
        if "responses" not in columns:
            if flags is not None:
                raise InvalidArgument("put_experience: rollout_completed goes with responses; put them together")
            return None
        if flags is None:
            raise InvalidArgument(
                "put_experience: with partial rollout (max_age > 1) a put of responses needs rollout_completed "
                "(1 where the response is finished, 0 where its rollout continues)"
            )
        try:
            return [int(torch.as_tensor(f).reshape(-1)[0]) == 1 for f in flags]
        except (TypeError, ValueError, IndexError, RuntimeError) as exc:
            raise InvalidArgument(f"rollout_completed must hold one 0/1 value per row ({exc})") from None

    # -- get ---------------------------------------------------------------------------------

    def get_experience(
        self,
        consumer: str,
        experience_columns: Sequence[str],
        experience_count: int | None = None,
        dp_size: int = 1,
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = True,
        use_batch_seqlen_balance: bool = False,
        allow_partial_ready_data: bool = False,
        *,
        timeout: float | None = None,
        layout: str | None = None,
    ) -> tuple[TensorDict | None, list[int] | None]:
        """Rows for ``consumer``: ``(TensorDict of the columns, row indexes)`` or ``(None, None)``.

        Without ``indexes``: ``experience_count`` ready rows the consumer has not consumed (whole
        prompts with ``get_n_samples``), claimed atomically; ``(None, None)`` if too few are
        ready, at once (``timeout=None``, as MindSpeed-RL) or after waiting up to ``timeout``
        seconds on the dock's event stream. With ``indexes``: those rows (repeats allowed), marked
        consumed, waiting up to ``timeout`` seconds (None: as long as it takes) for their columns.
        The TensorDict is padded with ``original_length`` (``layout="padded"``) or jagged.
        With partial rollout ``actor_rollout`` claims with ``get_n_samples=False``, takes what is
        ready (up to ``experience_count``), gets an ``age`` column, and a short claim is padded to a
        multiple of ``dp_size`` with row index -2; other consumers see only the ready mask's rows.
        ``allow_partial_ready_data`` does nothing (as in MindSpeed).
        """
        self._check_consumer(consumer)
        dp_size = int_at_least("dp_size", dp_size, 1)
        layout = check_layout(layout if layout is not None else self.layout)
        rollout = self._partial is not None and consumer == "actor_rollout"
        if rollout:
            if get_n_samples:
                raise InvalidArgument(
                    "get_n_samples is not supported for actor_rollout with partial rollout (max_age > 1): "
                    "pass get_n_samples=False"
                )
            experience_columns = [c for c in experience_columns if c != "age"]  # always added
        columns = self._check_columns(experience_columns)
        if not columns:
            raise InvalidArgument("experience_columns is empty: name the columns to get")
        if indexes is not None:
            rows = self._check_indexes(indexes, unique=False)
            meta = self._run(self._read_rows(rows, columns, timeout, consumer))
            if rollout:
                return self._rollout_batch(meta, rows, columns, None, dp_size, layout)
            return as_layout(self._client.get_data(meta), columns, layout), rows
        count = self._check_count(experience_count, get_n_samples and not rollout, divides=self._partial is None)
        balanced = use_batch_seqlen_balance and consumer in self.batch_seqlen_balance_mapper
        meta = self._run(self._claim(consumer, columns, count, get_n_samples, balanced, timeout))
        if meta is None:
            return None, None
        rows = [int(m["dock_index"]) for m in meta.custom_meta]
        if rollout:
            return self._rollout_batch(meta, rows, columns, count, dp_size, layout)
        return as_layout(self._client.get_data(meta), columns, layout), rows

    def _rollout_batch(self, meta: BatchMeta, rows: list[int], columns: list[str], count: int | None,
                       dp_size: int, layout: str) -> tuple[TensorDict, list[int]]:
        """A rollout claim's result, as MindSpeed's: the rows plus ``age``, responses marked unwritten,
        and (when fewer than ``count``) the last row repeated up to a multiple of ``dp_size`` with
        index -2."""
        td = self._client.get_data(meta)
        ages = self._run(self._partial.ages(rows))
        self._run(self._partial.after_rollout_claim(list(dict.fromkeys(meta.global_indexes))))
        if count is not None and len(rows) < count:
            pad = -len(rows) % dp_size
            td = td[[*range(len(rows)), *[len(rows) - 1] * pad]]
            ages, rows = ages + [ages[-1]] * pad, rows + [PAD_INDEX] * pad
        td.set("age", age_column(ages))
        return as_layout(td, [*columns, "age"], layout), rows

    def _check_count(self, count: Any, get_n_samples: bool, divides: bool = True) -> int:
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1:
            raise InvalidArgument(f"experience_count must be an int >= 1 without indexes, got {count!r}")
        count = int(count)
        if divides and (count > self.max_len or self.max_len % count):
            raise InvalidArgument(f"experience_count ({count}) must divide the dock's {self.max_len} rows")
        if count > self.max_len:  # partial rollout: any count up to the dock's rows (MindSpeed)
            raise InvalidArgument(f"experience_count ({count}) is more than the dock's {self.max_len} rows")
        if get_n_samples and count % self.n_samples_per_prompt:
            raise InvalidArgument(
                f"get_n_samples needs experience_count ({count}) to be a multiple of n_samples_per_prompt "
                f"({self.n_samples_per_prompt}); pass get_n_samples=False for single rows"
            )
        return count

    def _over_cap(self, consumer: str) -> Op:
        if not self.GBS_train:
            return False
        consumed = yield Cmd(("BITCOUNT", self._pk.cons(consumer)))
        return int(consumed) >= self.GBS_train * self.n_samples_per_prompt

    def _claim(self, consumer: str, columns: list[str], count: int, grouped: bool, balanced: bool,
               timeout: float | None) -> Op:
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            if grouped and (yield from self._over_cap(consumer)):
                return None  # only a clear lowers the count
            last = yield from self._last_event()  # any change after this wakes the wait below
            if self._partial is not None:
                rollout = consumer == "actor_rollout"
                choose = self._partial.chooser(count, rollout, grouped)
                got = yield from ops.claim_choice(self._pk, consumer, columns, 1 if rollout else count, choose,
                                                  attempts=_CLAIM_RETRIES)
                meta = got.meta
            elif balanced:
                meta = yield from self._claim_balanced(consumer, columns, count, grouped)
            else:
                config: dict[str, Any] = {"sampler": "SequentialSampler"}
                if grouped and self.n_samples_per_prompt > 1:
                    config = {"sampler": "GRPOGroupNSampler", "n_samples_per_prompt": self.n_samples_per_prompt}
                meta = yield from ops.get_meta(self._ctx, columns, count, self.partition_id, "fetch", consumer, config)
                meta = meta if meta.size else None
            remaining = deadline - time.monotonic()
            if meta is not None or remaining <= 0:
                return meta
            yield Wait(self._pk.events, last, min(remaining, WAIT_SLICE_S))

    def _claim_balanced(self, consumer: str, columns: list[str], count: int, grouped: bool) -> Op:
        """Choose a seqlen-balanced set of ready rows in the client and claim it if still free."""
        n = self.n_samples_per_prompt if grouped else 1
        want = count // n
        seqlen_columns = self.batch_seqlen_balance_mapper[consumer]

        def choose(ready: list[int]) -> Op:
            units = yield from self._units(ready, n)
            if len(units) < want:
                return None
            chosen = units[:want]
            if len(units) > want and len(units) % want == 0:
                weights = yield from self._unit_lengths(units, seqlen_columns)
                chosen = [units[i] for i in karmarkar_karp(weights, len(units) // want)[0]]
            ids = [i for unit in chosen for i in unit]
            return ids, ids

        got = yield from ops.claim_choice(self._pk, consumer, columns, count, choose, attempts=_CLAIM_RETRIES)
        return got.meta  # None also when other consumers kept taking the choice: the caller waits

    def _units(self, ready: list[int], n: int) -> Op:
        """Ready ids as claimable units: single rows, or the complete prompts (groups of n)."""
        if n == 1:
            return [[i] for i in ready]
        uids = yield Cmd(("HMGET", self._pk.tag("uid"), *ready))
        groups: dict[int, list[int]] = {}
        for sid, uid in zip(ready, uids):
            if uid is not None:
                groups.setdefault(int(uid), []).append(sid)
        return [ids for _, ids in sorted(groups.items()) if len(ids) == n]

    def _unit_lengths(self, units: list[list[int]], seqlen_columns: list[str]) -> Op:
        """The summed ``seqlen_columns`` of each unit; raises if some row lacks them."""
        ids = [i for unit in units for i in unit]
        visible, schemas = yield from transitions.pipeline(
            transitions.check_visible(self._pk, ids, seqlen_columns), Cmd(("HMGET", self._pk.fields, *seqlen_columns))
        )
        if any(s is None for s in schemas) or not visible.ok:
            raise InvalidArgument(
                f"use_batch_seqlen_balance needs {seqlen_columns} put for every ready row; put them first "
                f"or pass use_batch_seqlen_balance=False"
            )
        meta = BatchMeta.from_columns(
            ids, self.partition_id,
            {c: to_batchmeta_schema(json.loads(s)) for c, s in zip(seqlen_columns, schemas)},
            production_status=1,
        )
        td = yield from ops.get_data(self._ctx, meta)
        per_id = {sid: sum(float(td[c][pos].sum()) for c in seqlen_columns) for pos, sid in enumerate(ids)}
        return [sum(per_id[i] for i in unit) for unit in units]

    # -- state -------------------------------------------------------------------------------

    def all_consumed(self, consumer: str, get_n_samples: bool = True) -> bool:
        """True once every one of the dock's rows exists and ``consumer`` has consumed it."""
        self._check_consumer(consumer)
        if self._partial is not None:  # MindSpeed: a step's worth (GBS_train prompts)
            if consumer == "actor_rollout":
                return self._run(self._partial.done_groups()) >= self.GBS_train
            consumed = self._cmd("BITCOUNT", self._pk.cons(consumer))
            return int(consumed) == self.GBS_train * self.n_samples_per_prompt
        state = self._run(streaming.progress(self._ctx, self.partition_id, consumer, []))
        return state.alive == self.max_len and state.pending == 0

    def get_consumer_status(self) -> dict[str, torch.Tensor]:
        """Per consumer, an int32 tensor over the rows: 1 where the consumer has consumed the row."""
        status = self._run(self._row_status([self._pk.cons(c) for c in self.experience_consumers]))
        return dict(zip(self.experience_consumers, status))

    def _rollout_status(self) -> tuple[torch.Tensor, torch.Tensor]:
        status = self._column_status(["prompts", "responses"])
        return status["prompts"], status["responses"]

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """Whether ``GBS_train`` prompts have all their responses (and, if required, every row has).

        With partial rollout: whether ``GBS_train`` prompts have finished their rollouts (and, if
        required, every row of age ``max_age - 1`` has); it also refreshes the ready mask.
        """
        if self._partial is not None:
            return self._run(self._partial.update_ready(require_max_age_all_finished))
        _, done = self._rollout_status()
        groups = int(done.view(self.prompts_num, self.n_samples_per_prompt).all(dim=1).sum())
        ready = groups >= self.GBS_train
        if require_max_age_all_finished:
            ready = ready and bool(done.all())
        return ready

    def get_incomplete_response_num(self) -> torch.Tensor:
        """Rows holding a prompt whose responses are not put yet (a 0-d int64 tensor, as MindSpeed).

        With partial rollout: rows holding a prompt minus rows whose rollout is finished.
        """
        if self._partial is not None:  # MindSpeed: prompts put minus rollouts finished
            prompts = self._column_status(["prompts"])["prompts"]
            done, _, _ = self._run(self._partial.state())
            return (prompts.sum() - int(done.sum())).to(torch.int64)
        prompts, done = self._rollout_status()
        return (prompts.sum() - (prompts & done).sum()).to(torch.int64)

    def clear(self, consumer: str = "actor_train") -> None:
        """Drop every row, column, consumer status, request index and metric (start the next step).

        With partial rollout, only the rows ``consumer`` consumed are dropped; the others age by one
        and whole prompts are re-sorted oldest first (:mod:`tq_redis.dock.aging`).
        """
        self._check_consumer(consumer)

        def op() -> Iterator[Any]:
            if self._partial is not None:
                yield from self._partial.clear(consumer)
            else:
                yield from ops.clear_partition(self._ctx, self.partition_id)
            yield from transitions.dock_reset(self._pk).call()

        self._run(op())
