"""``GRPOTransferDock``: MindSpeed-RL's experience dock, with its state in Redis instead of a Ray actor.

The signatures, defaults and results are MindSpeed-RL's (``mindspeed_rl/trainer/utils/transfer_dock.py``):
``GRPOTransferDock(prompts_num, n_samples_per_prompt, metrics=None, max_age=1, GBS_train=0,
addition_columns=None, addition_consumers=None, timeout=None, timeout_interval=None)``, then ours,
keyword-only: ``redis_url=``, ``namespace=``, ``name=``, ``layout=``. So ``ray.remote(GRPOTransferDock)``
is a drop-in for MindSpeed's actor class (the actor finds Redis through ``redis_url=`` or the
``TQ_REDIS_URL`` / ``TQ_NAMESPACE`` environment, e.g. Ray's ``runtime_env={"env_vars": ...}``).

Layout. A dock is one partition (``dock.<name>``) of ``prompts_num * n_samples_per_prompt`` rows.
Row ``i`` is the KV key ``str(i)`` (see :mod:`tq_redis.kv`), tagged ``uid = i // n`` (its prompt)
and ``dock_index = i``; columns are fields and consumers are tasks. Beside the partition's own
keys a dock uses ``<ns>:{dock.<name>}:dock`` (HASH: its ``prompts_num`` and
``n_samples_per_prompt``, kept across clears), ``...:dockstate`` (HASH: ``cur_index``, the cursor
of ``prefetch_request_index``) and ``...:dockmetrics`` (LIST: one entry per ``update_metrics``
call, replayed in order by ``get_metrics``; an append is atomic, so concurrent updates are never
lost). ``clear`` deletes all but the first. Any number of processes may build the same dock (same
``name=``) or receive it pickled (it pickles to its address); every claim is one atomic script:

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
* ``max_age > 1`` (partial rollout: re-queued rollouts, ages, row re-sorting) is not implemented
  and raises :class:`~tq_redis.errors.InvalidArgument` rather than silently behaving like
  ``max_age=1``. ``dp_size`` and ``allow_partial_ready_data`` are accepted and, as in MindSpeed
  without partial rollout, do nothing.
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
  the object's own ``update``; the dock's metrics start empty. An update the object rejects
  raises :class:`~tq_redis.errors.InvalidArgument` and is not recorded.
* Additions: ``put_experience`` returns the rows written, may omit ``indexes`` (rows are then
  appended after the last ones handed out) and takes ``repeat_prompts=True`` (each row is a
  prompt stored in its ``n_samples_per_prompt`` rows; ``indexes`` then name prompts);
  ``get_experience`` takes ``timeout=`` (None: claims return at once and reads by index wait as
  long as it takes, as in MindSpeed) and ``layout=``. ``get_update_ready`` and
  ``get_incomplete_response_num`` count a row's rollout complete once its ``responses`` are put
  (with ``max_age=1`` a rollout is never continued; MindSpeed only tracks completion under partial
  rollout and returns constants otherwise).
"""

from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.nn.utils.rnn import pad_sequence

from tq_redis import bitmaps, kv, objects, ops, streaming
from tq_redis.channel import resolve_target
from tq_redis.driver import Cmd, Pipe, Wait
from tq_redis.errors import BatchSizeMismatch, ConfigError, InvalidArgument
from tq_redis.metadata import BatchMeta
from tq_redis.samplers import karmarkar_karp
from tq_redis.schemas import to_batchmeta_schema
from tq_redis.sync import TransferQueueClient

Op = ops.Op
log = logging.getLogger(__name__)

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
ORIGINAL_LENGTH = "original_length"
LAYOUTS = ("padded", "jagged")
DEFAULT_TIMEOUT_S = 300
DEFAULT_TIMEOUT_INTERVAL_S = 5
_CLAIM_RETRIES = 16
_WAIT_SLICE_S = 5.0


# ------------------------------------------------------------------ argument checks


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _seconds(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidArgument(f"{name} must be a number of seconds > 0 (or None for {default}), got {value!r}")
    return value


def _layout(value: str) -> str:
    if value not in LAYOUTS:
        raise InvalidArgument(f"layout must be one of {LAYOUTS}, got {value!r}")
    return value


def _extend(base: Sequence[str], extra: Sequence[str] | None) -> list[str]:
    out = list(base)
    for name in extra or ():
        if name not in out:
            out.append(name)
    return out


# ------------------------------------------------------------------ rows in, rows out


def _rows(name: str, value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.ndim else [value]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise InvalidArgument(f"column {name!r}: give a tensor (one row per index) or a list of rows")


def _lengths(value: Any, expected: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        lengths = value.reshape(-1).tolist()
    elif isinstance(value, Sequence):
        lengths = [int(v) for v in value]
    else:
        raise InvalidArgument(f"{ORIGINAL_LENGTH} must be a tensor or a list of row lengths")
    if len(lengths) != expected:
        raise BatchSizeMismatch(
            f"{ORIGINAL_LENGTH} holds {len(lengths)} lengths but the columns hold {expected} rows; it needs "
            f"one length per row, column after column (as padding_dict_to_tensor_dict makes it)"
        )
    if any(n < 0 for n in lengths):
        raise InvalidArgument(f"{ORIGINAL_LENGTH} holds negative lengths")
    return [int(n) for n in lengths]


def _unpadded(data_dict: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Column -> rows; with ``original_length`` each row is cut back to its length (padding dropped)."""
    if not hasattr(data_dict, "items"):
        raise InvalidArgument(f"data_dict must be a dict or TensorDict of columns, got {type(data_dict).__name__}")
    items = [(str(k), v) for k, v in data_dict.items() if v is not None]
    columns = {k: _rows(k, v) for k, v in items if k != ORIGINAL_LENGTH}
    raw_lengths = next((v for k, v in items if k == ORIGINAL_LENGTH), None)
    if raw_lengths is None:
        return columns
    lengths = iter(_lengths(raw_lengths, sum(len(r) for r in columns.values())))
    out = {}
    for name, rows in columns.items():
        cut = []
        for row in rows:
            n = next(lengths)
            if isinstance(row, torch.Tensor) and row.ndim:
                if n > row.shape[0]:
                    raise InvalidArgument(f"column {name!r}: {ORIGINAL_LENGTH} {n} exceeds the row's {row.shape[0]}")
                row = row[:n]
            cut.append(row)
        out[name] = cut
    return out


def _column(name: str, rows: list[Any]) -> Any:
    """One field: dense for scalar rows, a jagged nested tensor for tensor rows (lengths may vary)."""
    if all(isinstance(r, torch.Tensor) for r in rows):
        if all(r.ndim == 0 for r in rows):
            return torch.stack(rows)
        try:
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        except (RuntimeError, ValueError) as exc:
            raise InvalidArgument(f"column {name!r}: rows must share dtype and all but the first dim ({exc})") from exc
    return rows


def _row_tensors(name: str, value: Any) -> list[torch.Tensor]:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(
            f"column {name!r} holds non-tensor rows, which the padded layout cannot return; use layout='jagged'"
        )
    return list(value.unbind())


def _padded(name: str, rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Rows zero-padded along their first dimension, and each row's length (1 for a scalar)."""
    if all(r.ndim == 0 for r in rows):
        return torch.stack(rows), [1] * len(rows)
    if any(r.ndim == 0 for r in rows):
        raise InvalidArgument(f"column {name!r} mixes scalar and tensor rows; get it with layout='jagged'")
    try:
        padded = pad_sequence(rows, batch_first=True, padding_value=0)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgument(
            f"column {name!r}: rows differ beyond their first dimension or in dtype ({exc}); "
            f"get it with layout='jagged'"
        ) from exc
    return padded, [int(r.shape[0]) for r in rows]


def _as_layout(td: TensorDict, columns: list[str], layout: str) -> TensorDict:
    if layout == "jagged":
        return td
    batch: dict[str, torch.Tensor] = {}
    lengths: list[int] = []
    for name in columns:
        batch[name], row_lengths = _padded(name, _row_tensors(name, td[name]))
        lengths.extend(row_lengths)
    batch[ORIGINAL_LENGTH] = torch.tensor(lengths, dtype=torch.int64)
    return TensorDict.from_dict(batch)


def _rebuild(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls(*args, **kwargs)


def _one(effect: Any) -> Op:
    return (yield effect)


# ------------------------------------------------------------------ metrics


class DockMetrics:
    """The metrics a dock keeps when it was built without ``metrics=``: MindSpeed-RL's ``Metric`` contract.

    ``metric`` maps a name to its value. ``update(key, value)`` sets one; ``update(value=dict)``
    sets several; with ``cumulate=True`` the values (lists) are appended to what is there (a
    name not there yet starts as a list of them; a name holding a non-list value is replaced).
    """

    def __init__(self) -> None:
        self.metric: dict[str, Any] = {}

    def update(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        """Set (or with ``cumulate`` append to) ``key``, or every key of a dict ``value``."""
        pairs = list(value.items()) if isinstance(value, Mapping) else [(key, value)]
        for name, item in pairs:
            if not cumulate:
                self.metric[name] = item
            elif isinstance(self.metric.get(name), list):
                self.metric[name].extend(item)
            elif name in self.metric:
                self.metric[name] = item
            else:
                self.metric[name] = list(item)

    def reset(self) -> None:
        """Forget every metric."""
        self.metric = {}

    def __repr__(self) -> str:
        return f"DockMetrics({self.metric!r})"


# ------------------------------------------------------------------ the base dock


class TransferDock:
    """Rows x columns of experience kept in Redis: MindSpeed-RL's ``TransferDock`` base class.

    Args:
        prompts_num: prompts per step; the dock has ``prompts_num * n_samples_per_prompt`` rows.
        n_samples_per_prompt: responses per prompt (rows ``[p*n, (p+1)*n)`` belong to prompt p).
        experience_columns: the column names.
        timeout: seconds a read by index waits before it logs a warning (None: 300).
        timeout_interval: seconds between those warnings (None: 5).
        redis_url / namespace: where the dock lives (default: ``tq_redis.init()``'s, or
            ``TQ_REDIS_URL`` / ``TQ_NAMESPACE``).
        name: the dock to attach to (its partition is ``dock.<name>``); None makes a new one.
        layout: ``"padded"`` (MindSpeed's result layout) or ``"jagged"`` (nested tensors).
    """

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int,
        experience_columns: Sequence[str] | None,
        timeout: float | None = None,
        timeout_interval: float | None = None,
        *,
        redis_url: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        layout: str = "padded",
    ) -> None:
        self.prompts_num = _int_at_least("prompts_num", prompts_num, 1)
        self.n_samples_per_prompt = _int_at_least("n_samples_per_prompt", n_samples_per_prompt, 1)
        self.max_len = self.prompts_num * self.n_samples_per_prompt
        self.experience_columns = _extend((), experience_columns)
        self.timeout = _seconds("timeout", timeout, DEFAULT_TIMEOUT_S)
        self.timeout_interval = _seconds("timeout_interval", timeout_interval, DEFAULT_TIMEOUT_INTERVAL_S)
        self.layout = _layout(layout)
        self.name = name if name is not None else uuid.uuid4().hex
        try:
            url, ns, allow_pickle = resolve_target(redis_url, namespace)
        except ConfigError:
            raise ConfigError(
                f"{type(self).__name__} needs the Redis URL: pass redis_url=, export TQ_REDIS_URL (for a Ray actor: "
                f"options(runtime_env={{'env_vars': {{'TQ_REDIS_URL': ...}}}})), or call tq_redis.init() first "
                f"(in this process, or in the Ray job's driver: its actors then find that system)"
            ) from None
        self.redis_url, self.namespace = url, ns
        self.partition_id = f"dock.{self.name}"
        self._client = TransferQueueClient(url, ns, allow_pickle=allow_pickle)
        self._ctx = self._client.context
        self._pk = self._ctx.keys(self.partition_id)
        self._shape_key = self._pk.prefix + "dock"
        self._state_key = self._pk.prefix + "dockstate"
        self._metrics_key = self._pk.prefix + "dockmetrics"
        self._spec: tuple[tuple, dict] = (
            (prompts_num, n_samples_per_prompt, experience_columns, timeout, timeout_interval),
            self._where(),
        )
        try:
            self._register_shape()
        except BaseException:
            self._client.close()
            raise

    def _where(self) -> dict[str, Any]:
        return {"redis_url": self.redis_url, "namespace": self.namespace, "name": self.name, "layout": self.layout}

    def __reduce__(self):
        # a dock pickles to its address: the copy attaches to the same rows
        return _rebuild, (type(self), *self._spec)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, {self.prompts_num} prompts x "
                f"{self.n_samples_per_prompt}, namespace={self.namespace!r})")

    def _run(self, op: Op) -> Any:
        return self._client.run(op)

    def _cmd(self, *args: Any) -> Any:
        return self._run(_one(Cmd(args)))

    def _register_shape(self) -> None:
        shape = (self.prompts_num, self.n_samples_per_prompt)
        _, _, got = self._run(_one(Pipe((
            Cmd(("HSETNX", self._shape_key, "prompts_num", shape[0])),
            Cmd(("HSETNX", self._shape_key, "n_samples_per_prompt", shape[1])),
            Cmd(("HMGET", self._shape_key, "prompts_num", "n_samples_per_prompt")),
        ))))
        registered = tuple(int(v) for v in got)
        if registered != shape:
            raise InvalidArgument(
                f"dock {self.name!r} in namespace {self.namespace!r} has {registered[0]} prompts x {registered[1]} "
                f"samples, not {shape[0]} x {shape[1]}; give this dock another name= (or leave name out for a new one)"
            )

    # -- validation --------------------------------------------------------------------------

    def _check_columns(self, columns: Sequence[str]) -> list[str]:
        if isinstance(columns, str):
            columns = [columns]
        unknown = [c for c in columns if c not in self.experience_columns]
        if unknown:
            raise InvalidArgument(
                f"columns {unknown} are not dock columns {self.experience_columns}; add them with addition_columns="
            )
        return _extend((), columns)

    def _check_indexes(self, indexes: Sequence[int], *, unique: bool = True) -> list[int]:
        try:
            out = [int(i) for i in indexes]
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"indexes must be a list of row numbers, got {indexes!r:.80}") from exc
        if not out:
            raise InvalidArgument("indexes is empty: name at least one row")
        bad = [i for i in out if not 0 <= i < self.max_len]
        if bad:
            raise InvalidArgument(f"indexes {bad[:10]} are outside the dock's rows [0, {self.max_len})")
        if unique and len(set(out)) != len(out):
            raise InvalidArgument("indexes must be unique: each row is written once per put")
        return out

    # -- writing and reading rows ------------------------------------------------------------

    def _write(self, columns: dict[str, list[Any]], rows: list[int]) -> None:
        fields = TensorDict({c: _column(c, r) for c, r in columns.items()}, batch_size=[len(rows)])
        tags = [{"uid": i // self.n_samples_per_prompt, "dock_index": i} for i in rows]
        self._client.kv_batch_put([str(i) for i in rows], self.partition_id, fields, tags)

    def _put(self, experience_columns: Sequence[str], experience: Sequence[Sequence[Any]],
             indexes: Sequence[int]) -> None:
        """Write ``experience[j][k]`` as column ``experience_columns[j]`` of row ``indexes[k]``."""
        columns = self._check_columns(experience_columns)
        if len(columns) != len(experience):
            raise BatchSizeMismatch(f"{len(columns)} columns but {len(experience)} lists of rows")
        rows = self._check_indexes(indexes)
        counts = [len(values) for values in experience]
        if any(c != len(rows) for c in counts):
            raise BatchSizeMismatch(f"{len(rows)} indexes but the columns hold {counts} rows")
        self._write({c: list(v) for c, v in zip(columns, experience)}, rows)

    def _get(self, experience_columns: Sequence[str], indexes: Sequence[int]) -> list[list[Any]]:
        """The rows ``indexes`` of each column (waiting until they are put), column after column."""
        columns = self._check_columns(experience_columns)
        rows = self._check_indexes(indexes, unique=False)
        meta = self._run(self._read_rows(rows, columns, None))
        td = self._client.get_data(meta)
        return [_row_tensors(c, td[c]) for c in columns]

    def _last_event(self) -> Op:
        last = yield Cmd(("XREVRANGE", self._pk.events, "+", "-", "COUNT", 1))
        return last[0][0].decode() if last else "0-0"

    def _read_rows(self, rows: list[int], columns: list[str], timeout: float | None,
                   consumer: str | None = None) -> Op:
        """BatchMeta of ``rows`` (in order, repeats allowed) once their columns are stored.

        Waits up to ``timeout`` seconds (None: as long as it takes, warning after ``self.timeout``
        and then every ``self.timeout_interval``); marks the rows consumed by ``consumer``.
        """
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        warn_at = started + self.timeout
        unique = list(dict.fromkeys(rows))
        keys = [str(i) for i in unique]
        while True:
            last = yield from self._last_event()
            res = yield from kv.resolve(self._ctx, self._pk, keys, False, [])
            if res is not None and min(res.ids) >= 0 and all(c in res.schemas for c in columns):
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"dock rows {unique[:10]} did not get columns {columns} within {timeout}s")
            if now >= warn_at:
                log.warning("dock %r: rows %s have waited %.0fs for columns %s", self.name, unique[:10],
                            now - started, columns)
                warn_at = now + self.timeout_interval
            slice_s = min(_WAIT_SLICE_S, max(0.001, warn_at - now))
            if deadline is not None:
                slice_s = min(slice_s, deadline - now)
            yield Wait(self._pk.events, last, slice_s)
        if consumer is not None:
            yield Pipe((
                Cmd(("SADD", self._pk.tasks, consumer)),
                Cmd(("BITFIELD", self._pk.cons(consumer), *[x for i in res.ids for x in ("SET", "u1", i, 1)])),
            ))
        position = {row: k for k, row in enumerate(unique)}
        return res.meta(self.partition_id, columns, [position[r] for r in rows])

    def _row_status(self, bitmap_keys: list[str]) -> Op:
        """Per bitmap key, a 0/1 int32 tensor over the dock's rows (bit of each row's sample id)."""
        ids = yield Cmd(("HMGET", self._pk.kv, *[str(i) for i in range(self.max_len)]))
        raws = (yield Pipe(tuple(Cmd(("GET", key)) for key in bitmap_keys))) if bitmap_keys else []
        rows = np.array([row for row, sid in enumerate(ids) if sid is not None], dtype=np.int64)
        sids = np.array([int(sid) for sid in ids if sid is not None], dtype=np.int64)
        out = []
        for raw in raws:
            bits = bitmaps.unpack(raw)
            status = np.zeros(self.max_len, dtype=np.int32)
            inside = sids < len(bits)
            status[rows[inside]] = bits[sids[inside]]
            out.append(torch.from_numpy(status))
        return out

    def _column_status(self, columns: Sequence[str]) -> dict[str, torch.Tensor]:
        status = self._run(self._row_status([self._pk.prod(c) for c in columns]))
        return dict(zip(columns, status))

    # -- MindSpeed's base-class API -------------------------------------------------------------

    def get_experience_data(self) -> dict[str, list[Any]]:
        """Every column's rows: ``{column: [row value, or None where not put]}``."""
        status = self._column_status(self.experience_columns)
        out: dict[str, list[Any]] = {}
        for column in self.experience_columns:
            rows = torch.nonzero(status[column]).flatten().tolist()
            values: list[Any] = [None] * self.max_len
            if rows:
                meta = self._run(self._read_rows(rows, [column], 0.0))
                got = self._client.get_data(meta)[column]
                for row, value in zip(rows, got.unbind() if isinstance(got, torch.Tensor) else got):
                    values[row] = value
            out[column] = values
        return out

    def get_experience_status(self) -> dict[str, torch.Tensor]:
        """Per column, an int32 tensor over the rows: 1 where the column is put."""
        return self._column_status(self.experience_columns)

    @property
    def experience_data(self) -> dict[str, list[Any]]:
        """A snapshot of :meth:`get_experience_data` (MindSpeed's attribute; read-only here)."""
        return self.get_experience_data()

    @property
    def experience_data_status(self) -> dict[str, torch.Tensor]:
        """A snapshot of :meth:`get_experience_status` (MindSpeed's attribute; read-only here)."""
        return self.get_experience_status()

    def get_experience_len(self) -> int:
        """Rows of the dock (``prompts_num * n_samples_per_prompt``)."""
        return self.max_len

    def close(self) -> None:
        """Close this process's connection (the dock stays)."""
        self._client.close()


# ------------------------------------------------------------------ MindSpeed's GRPO dock


class GRPOTransferDock(TransferDock):
    """The experience dock of a GRPO step, with MindSpeed-RL's ``GRPOTransferDock`` API.

    Args:
        prompts_num: prompts per step; the dock has ``prompts_num * n_samples_per_prompt`` rows.
        n_samples_per_prompt: responses per prompt (rows ``[p*n, (p+1)*n)`` belong to prompt p).
        metrics: an object with ``update(key, value, cumulate=)`` and ``reset()`` (MindSpeed's
            ``Metric``); ``get_metrics`` returns copies of it. None: a :class:`DockMetrics`.
        max_age: 1 (MindSpeed's partial rollout, ``max_age > 1``, is not supported).
        GBS_train: with ``get_n_samples``, a consumer gets nothing more once it has consumed
            ``GBS_train * n_samples_per_prompt`` rows; 0: no cap.
        addition_columns / addition_consumers: names beyond MindSpeed-RL's defaults.
        timeout / timeout_interval: a read by index logs a warning after ``timeout`` seconds
            (None: 300) and then every ``timeout_interval`` seconds (None: 5).
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
        *,
        redis_url: str | None = None,
        namespace: str | None = None,
        name: str | None = None,
        layout: str = "padded",
    ) -> None:
        if _int_at_least("max_age", max_age, 1) > 1:
            raise InvalidArgument(
                f"max_age={max_age} asks for MindSpeed-RL's partial rollout, which tq_redis's dock does not "
                f"implement; use max_age=1"
            )
        if metrics is not None and not callable(getattr(metrics, "update", None)):
            raise InvalidArgument(
                f"metrics must have update(key, value, cumulate=) like MindSpeed-RL's Metric, "
                f"got {type(metrics).__name__}"
            )
        self.max_age = 1
        self.GBS_train = _int_at_least("GBS_train", GBS_train, 0)
        self.enable_partial_rollout = False
        self.metrics = metrics
        self.experience_consumers = _extend(EXPERIENCE_CONSUMERS, addition_consumers)
        self.batch_seqlen_balance_mapper = {c: list(SEQLEN_COLUMNS) for c in SEQLEN_BALANCE_CONSUMERS}
        super().__init__(
            prompts_num, n_samples_per_prompt, _extend(EXPERIENCE_COLUMNS, addition_columns), timeout,
            timeout_interval, redis_url=redis_url, namespace=namespace, name=name, layout=layout,
        )
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

    def _new_metrics(self) -> Any:
        if self.metrics is None:
            return DockMetrics()
        fresh = copy.deepcopy(self.metrics)
        if callable(getattr(fresh, "reset", None)):
            fresh.reset()
        elif hasattr(fresh, "metric"):
            fresh.metric = {}
        return fresh

    def update_metrics(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        """Record ``metrics.update(key, value, cumulate=cumulate)`` for every process of the dock."""
        try:
            self._new_metrics().update(key, value, cumulate=cumulate)
        except Exception as exc:  # the metrics object's own check; nothing is recorded
            raise InvalidArgument(
                f"update_metrics({key!r}, {value!r:.60}, cumulate={cumulate}) is rejected by the metrics object "
                f"({exc}); with cumulate=True give a list (or a dict of lists)"
            ) from exc
        entry = objects.encode_object([key, value, bool(cumulate)], allow_pickle=self._ctx.allow_pickle)
        self._cmd("RPUSH", self._metrics_key, entry)

    def get_metrics(self) -> Any:
        """A copy of the ``metrics`` object holding every update since the last ``clear``."""
        entries = self._cmd("LRANGE", self._metrics_key, 0, -1)
        out = self._new_metrics()
        for raw in entries:
            key, value, cumulate = objects.decode_object(raw, allow_pickle=self._ctx.allow_pickle)
            out.update(key, value, cumulate=cumulate)
        return out

    # -- request indexes ---------------------------------------------------------------------

    def get_cur_index(self) -> int:
        """How many rows ``prefetch_request_index`` has handed out since the last ``clear``."""
        value = self._cmd("HGET", self._state_key, "cur_index")
        return int(value) if value is not None else 0

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """The next ``experience_num`` row numbers (fewer at the end of the dock); None once all are given."""
        num = _int_at_least("experience_num", experience_num, 0)
        end = int(self._cmd("HINCRBY", self._state_key, "cur_index", num))
        first = end - num
        if first >= self.max_len:
            self._cmd("HINCRBY", self._state_key, "cur_index", -num)  # as MindSpeed: no move past the end
            return None
        return list(range(first, min(end, self.max_len)))

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
        ``is_prompt`` marks MindSpeed's prompt put (it only matters for partial rollout). Ours:
        ``indexes`` may be left out (the rows after the last ones handed out are used), and with
        ``repeat_prompts`` every row is a prompt, stored in its ``n_samples_per_prompt`` rows, and
        ``indexes`` (if given) are prompt numbers.
        """
        columns = _unpadded(data_dict)
        self._check_columns(list(columns))
        if not columns:
            raise InvalidArgument("put_experience: data_dict has no column")
        counts = {c: len(r) for c, r in columns.items()}
        rows = next(iter(counts.values()))
        if set(counts.values()) != {rows} or rows == 0:
            raise BatchSizeMismatch(f"put_experience: every column needs the same (non-zero) row count, got {counts}")
        n = self.n_samples_per_prompt if repeat_prompts else 1
        if repeat_prompts:
            columns = {c: [r for r in values for _ in range(n)] for c, values in columns.items()}
        if indexes is None:
            first = int(self._cmd("HINCRBY", self._pk.meta, "dock_cursor", rows * n)) - rows * n
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
        rows_at = self._check_indexes(rows_at)
        self._write(columns, rows_at)
        return rows_at

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
        ``dp_size`` and ``allow_partial_ready_data`` only matter for partial rollout.
        """
        self._check_consumer(consumer)
        _int_at_least("dp_size", dp_size, 1)
        layout = _layout(layout if layout is not None else self.layout)
        columns = self._check_columns(experience_columns)
        if not columns:
            raise InvalidArgument("experience_columns is empty: name the columns to get")
        if indexes is not None:
            rows = self._check_indexes(indexes, unique=False)
            meta = self._run(self._read_rows(rows, columns, timeout, consumer))
            return _as_layout(self._client.get_data(meta), columns, layout), rows
        count = self._check_count(experience_count, get_n_samples)
        balanced = use_batch_seqlen_balance and consumer in self.batch_seqlen_balance_mapper
        meta = self._run(self._claim(consumer, columns, count, get_n_samples, balanced, timeout))
        if meta is None:
            return None, None
        rows = [int(m["dock_index"]) for m in meta.custom_meta]
        return _as_layout(self._client.get_data(meta), columns, layout), rows

    def _check_count(self, count: Any, get_n_samples: bool) -> int:
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1:
            raise InvalidArgument(f"experience_count must be an int >= 1 without indexes, got {count!r}")
        count = int(count)
        if count > self.max_len or self.max_len % count:
            raise InvalidArgument(f"experience_count ({count}) must divide the dock's {self.max_len} rows")
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
            if balanced:
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
            yield Wait(self._pk.events, last, min(remaining, _WAIT_SLICE_S))

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
        schemas = yield Cmd(("HMGET", self._pk.fields, *seqlen_columns))
        bitfield = [x for i in ids for x in ("GET", "u1", i)]
        produced = yield Pipe(tuple(Cmd(("BITFIELD", self._pk.prod(c), *bitfield)) for c in seqlen_columns))
        if any(s is None for s in schemas) or not all(all(bits) for bits in produced):
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
        """Whether ``GBS_train`` prompts have all their responses (and, if required, every row has)."""
        _, done = self._rollout_status()
        groups = int(done.view(self.prompts_num, self.n_samples_per_prompt).all(dim=1).sum())
        ready = groups >= self.GBS_train
        if require_max_age_all_finished:
            ready = ready and bool(done.all())
        return ready

    def get_incomplete_response_num(self) -> torch.Tensor:
        """Rows holding a prompt whose responses are not put yet (a 0-d int64 tensor, as MindSpeed)."""
        prompts, done = self._rollout_status()
        return (prompts.sum() - (prompts & done).sum()).to(torch.int64)

    def clear(self, consumer: str = "actor_train") -> None:
        """Drop every row, column, consumer status, request index and metric (start the next step).

        ``consumer`` only matters for MindSpeed's partial rollout; it must name a consumer.
        """
        self._check_consumer(consumer)

        def op() -> Iterator[Any]:
            yield from ops.clear_partition(self._ctx, self.partition_id)
            yield Cmd(("DEL", self._state_key, self._metrics_key))

        self._run(op())
