"""``TransferDock``: MindSpeed-RL's base dock (rows x columns of experience) with its state in Redis.

A dock is one partition (``dock.<name>``) of ``prompts_num * n_samples_per_prompt`` rows. Row
``i`` is the KV key ``str(i)`` (see :mod:`tq_redis.ops.kv`), tagged ``uid = i // n`` (its prompt) and
``dock_index = i``; columns are fields. ``<ns>:{dock.<name>}:dock`` (HASH) records the dock's
shape, so attaching with another shape fails. This module holds the base class: construction and
attaching, checks of columns and indexes, writing rows and reading them by index (waiting on the
partition's event stream until their columns are put), per-row status, and MindSpeed's base-class
API. :mod:`tq_redis.dock.dock` builds ``GRPOTransferDock`` on it and documents the whole dock.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np
import torch
from tensordict import TensorDict

from tq_redis import names, ops
from tq_redis.api.system import resolve_target
from tq_redis.client.blocking import TransferQueueClient
from tq_redis.dock.layout import check_layout, row_tensors, rows_to_field
from tq_redis.errors import BatchSizeMismatch, ConfigError, InvalidArgument
from tq_redis.meta import bitmaps
from tq_redis.meta.keys import kept_partitions_key
from tq_redis.ops import kv, transitions
from tq_redis.ops.effects import Cmd, Pipe, Wait
from tq_redis.reprs import attrs_repr

Op = ops.Op
log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300
DEFAULT_TIMEOUT_INTERVAL_S = 5
WAIT_SLICE_S = 5.0  # the longest single wait on the event stream; a wait re-checks after it


# ------------------------------------------------------------------ argument checks


def int_at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, if it is an integer >= ``minimum`` (else ``InvalidArgument``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _seconds(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidArgument(f"{name} must be a number of seconds > 0 (or None for {default}), got {value!r}")
    return value


def extend_names(base: Sequence[str], extra: Sequence[str] | None) -> list[str]:
    """``base`` followed by the names of ``extra`` it lacks, in order."""
    out = list(base)
    for name in extra or ():
        if name not in out:
            out.append(name)
    return out


def _rebuild(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls(*args, **kwargs)


def _one(effect: Any) -> Op:
    return (yield effect)


# ------------------------------------------------------------------ the base dock


class DockPlace(TypedDict, total=False):
    """Where a dock lives: the keyword-only arguments every dock constructor takes (see
    :class:`TransferDock`); subclasses pass them on as ``**place``."""

    redis_url: str | None
    namespace: str | None
    name: str | None
    layout: str


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
        self.prompts_num = int_at_least("prompts_num", prompts_num, 1)
        self.n_samples_per_prompt = int_at_least("n_samples_per_prompt", n_samples_per_prompt, 1)
        self.max_len = self.prompts_num * self.n_samples_per_prompt
        # each column is a field of the dock's partition: checked (reserved names too) before anything is written
        self.experience_columns = [names.field_name(c, "dock column") for c in extend_names((), experience_columns)]
        self.timeout = _seconds("timeout", timeout, DEFAULT_TIMEOUT_S)
        self.timeout_interval = _seconds("timeout_interval", timeout_interval, DEFAULT_TIMEOUT_INTERVAL_S)
        self.layout = check_layout(layout)
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
        return attrs_repr(self, ("name", "prompts_num", "n_samples_per_prompt", "namespace"))

    def _run(self, op: Op) -> Any:
        return self._client.run(op)

    def _cmd(self, *args: Any) -> Any:
        return self._run(_one(Cmd(args)))

    def _register_shape(self) -> None:
        shape = (self.prompts_num, self.n_samples_per_prompt)
        # Listed in partitions:kept at once, so a checkpoint finds a dock that holds no rows yet (the
        # namespace's list, as clear_partition keeps it: on a cluster it lives in another slot).
        registered, _ = self._run(transitions.pipeline(
            transitions.dock_shape(self._pk, *shape),
            Cmd(("SADD", kept_partitions_key(self.namespace), self.partition_id)),
        ))
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
        return extend_names((), columns)

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

    def _row_tags(self, row: int) -> dict[str, int]:
        """The tags of row ``row``: its prompt (``uid``) and its row number (``dock_index``)."""
        return {"uid": row // self.n_samples_per_prompt, "dock_index": row}

    def _write(self, columns: dict[str, list[Any]], rows: list[int]) -> None:
        fields = TensorDict({c: rows_to_field(c, r) for c, r in columns.items()}, batch_size=[len(rows)])
        tags = [self._row_tags(i) for i in rows]
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
        return [row_tensors(c, td[c]) for c in columns]

    def _last_event(self) -> Op:
        last = yield Cmd(("XREVRANGE", self._pk.events, "+", "-", "COUNT", 1))
        return last[0][0].decode() if last else "0-0"

    def _read_rows(self, rows: list[int], columns: list[str], timeout: float | None,
                   consumer: str | None = None) -> Op:
        """BatchMeta of ``rows`` (in order, repeats allowed) once their columns are stored.

        Waits up to ``timeout`` seconds (None: as long as it takes, warning after ``self.timeout``
        and then every ``self.timeout_interval``); marks the rows consumed by ``consumer``
        (``lua/mark_consumed.lua``: counted by its rate limiter like a claim).
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
                if consumer is None:
                    break
                # marked in the script that checks them again (a row cleared meanwhile: wait on)
                marked = yield from transitions.mark_consumed(self._pk, consumer, res.ids, columns).call()
                if marked.ok:
                    break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"dock rows {unique[:10]} did not get columns {columns} within {timeout}s")
            if now >= warn_at:
                log.warning("dock %r: rows %s have waited %.0fs for columns %s", self.name, unique[:10],
                            now - started, columns)
                warn_at = now + self.timeout_interval
            slice_s = min(WAIT_SLICE_S, max(0.001, warn_at - now))
            if deadline is not None:
                slice_s = min(slice_s, deadline - now)
            yield Wait(self._pk.events, last, slice_s)
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
