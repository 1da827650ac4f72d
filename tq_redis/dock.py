"""``GRPOTransferDock``: MindSpeed-RL's experience dock, with its state in Redis instead of a Ray actor.

The dock is one partition (``dock.<name>``) of ``prompts_num * n_samples_per_prompt`` rows. Row
``i`` is the KV key ``str(i)`` (see :mod:`tq_redis.kv`), tagged ``uid = i // n`` (its prompt) and
``dock_index = i``; columns are fields and consumers are tasks. So any number of processes can
construct the same dock and share it, and every claim is one atomic script:

* ``get_experience`` without ``indexes`` claims ``experience_count`` ready rows the consumer has
  not consumed: with ``GRPOGroupNSampler`` (whole prompts, grouped by the ``uid`` tag) when
  ``get_n_samples``, else ``SequentialSampler``; ``(None, None)`` when too few are ready.
* ``use_batch_seqlen_balance`` chooses in the client, as MindSpeed does: the ready rows (or whole
  prompts) are split into ``ready // experience_count`` parts of equal size balanced by
  ``prompt_length + response_length`` (Karmarkar-Karp), and the first part is claimed only if
  all of it is still free (``lua/claim_ids.lua``; retried on conflict).
* ``get_experience`` with ``indexes`` marks them consumed and waits (on the partition's event
  stream, not by sleeping) until their columns are put.

Differences from MindSpeed-RL on purpose: ``put_experience`` may omit ``indexes`` (rows are then
appended after the last ones handed out, prompts aligned to whole groups) and ``is_prompt=True``
repeats each prompt row ``n_samples_per_prompt`` times (``indexes`` then name prompts); columns
keep their dtype (MindSpeed turns int64 into int32); variable-length columns come back as jagged
nested tensors instead of padded ones (``td[col].to_padded_tensor(pad_id)`` pads); ``clear()``
drops the partition (row ids are never reused).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from tq_redis import codec, kv, ops, streaming
from tq_redis.channel import resolve_target
from tq_redis.driver import Cmd, FCall, Pipe, Wait
from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.metadata import BatchMeta
from tq_redis.samplers import karmarkar_karp
from tq_redis.sync import TransferQueueClient

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
_CLAIM_RETRIES = 16
_WAIT_SLICE_S = 5.0


def _extend(base: Sequence[str], extra: Sequence[str] | None) -> list[str]:
    out = list(base)
    for name in extra or ():
        if name not in out:
            out.append(name)
    return out


def _rows(name: str, value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.ndim else [value]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise InvalidArgument(f"column {name!r}: give a tensor (one row per index) or a list of rows")


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


def _bits(raw: bytes) -> list[int]:
    return [8 * i + j for i, byte in enumerate(raw) for j in range(8) if byte & (0x80 >> j)]


class GRPOTransferDock:
    """The experience dock of a GRPO step, shared by every process that builds it with the same name.

    Args:
        prompts_num: prompts per step; the dock has ``prompts_num * n_samples_per_prompt`` rows.
        n_samples_per_prompt: responses per prompt (rows ``[p*n, (p+1)*n)`` belong to prompt p).
        addition_columns / addition_consumers: names beyond MindSpeed-RL's defaults.
        redis_url / namespace: where the dock lives (default: ``tq_redis.init()``'s, or
            ``TQ_REDIS_URL`` / ``TQ_NAMESPACE``).
        name: the dock's name (its partition is ``dock.<name>``).
    """

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int,
        addition_columns: Sequence[str] | None = None,
        addition_consumers: Sequence[str] | None = None,
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        name: str = "transfer_dock",
    ) -> None:
        for arg, value in (("prompts_num", prompts_num), ("n_samples_per_prompt", n_samples_per_prompt)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{arg} must be an int >= 1, got {value!r}")
        self.prompts_num = prompts_num
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_len = prompts_num * n_samples_per_prompt
        self.experience_columns = _extend(EXPERIENCE_COLUMNS, addition_columns)
        self.experience_consumers = _extend(EXPERIENCE_CONSUMERS, addition_consumers)
        url, ns, allow_pickle = resolve_target(redis_url, namespace)
        self.partition_id = f"dock.{name}"
        self._client = TransferQueueClient(url, ns, allow_pickle=allow_pickle)
        self._ctx = self._client._ctx
        self._pk = self._ctx.keys(self.partition_id)

    def _run(self, op: Op) -> Any:
        return self._client._driver.run(op)

    # -- validation --------------------------------------------------------------------------

    def _check_columns(self, columns: Sequence[str]) -> list[str]:
        unknown = [c for c in columns if c not in self.experience_columns]
        if unknown:
            raise InvalidArgument(
                f"columns {unknown} are not dock columns {self.experience_columns}; add them with addition_columns="
            )
        return list(columns)

    def _check_indexes(self, indexes: Sequence[int]) -> list[int]:
        out = [int(i) for i in indexes]
        bad = [i for i in out if not 0 <= i < self.max_len]
        if bad:
            raise InvalidArgument(f"indexes {bad[:10]} are outside the dock's rows [0, {self.max_len})")
        if len(set(out)) != len(out):
            raise InvalidArgument("indexes must be unique")
        return out

    # -- put ---------------------------------------------------------------------------------

    def put_experience(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int] | None = None, is_prompt: bool = False
    ) -> list[int]:
        """Write columns of rows; returns the row indexes written.

        ``data_dict`` maps column -> a tensor with one row per index, or a list of per-row tensors
        (lengths may differ). With ``is_prompt`` every row is a prompt, stored in its
        ``n_samples_per_prompt`` rows, and ``indexes`` (if given) are prompt numbers. Without
        ``indexes`` the rows after the last ones handed out are used.
        """
        columns = {c: _rows(c, v) for c, v in data_dict.items() if v is not None}
        self._check_columns(list(columns))
        if not columns:
            raise InvalidArgument("put_experience: data_dict has no column")
        counts = {c: len(r) for c, r in columns.items()}
        rows = next(iter(counts.values()))
        if set(counts.values()) != {rows} or rows == 0:
            raise BatchSizeMismatch(f"put_experience: every column needs the same (non-zero) row count, got {counts}")
        n = self.n_samples_per_prompt if is_prompt else 1
        if is_prompt:
            columns = {c: [r for r in values for _ in range(n)] for c, values in columns.items()}
        if indexes is None:
            first = self._client.redis.hincrby(self._pk.meta, "dock_cursor", rows * n) - rows * n
            if first % n:
                raise InvalidArgument(
                    f"put_experience(is_prompt=True) without indexes needs the dock's next free row ({first}) "
                    f"to start a prompt; pass indexes="
                )
            rows_at = list(range(first, first + rows * n))
        else:
            if len(indexes) != rows:
                raise BatchSizeMismatch(f"put_experience: {rows} rows but {len(indexes)} indexes")
            rows_at = [p * n + j for p in indexes for j in range(n)] if is_prompt else list(indexes)
        rows_at = self._check_indexes(rows_at)
        fields = TensorDict({c: _column(c, r) for c, r in columns.items()}, batch_size=[len(rows_at)])
        tags = [{"uid": i // self.n_samples_per_prompt, "dock_index": i} for i in rows_at]
        self._client.kv_batch_put([str(i) for i in rows_at], self.partition_id, fields, tags)
        return rows_at

    # -- get ---------------------------------------------------------------------------------

    def get_experience(
        self,
        consumer: str,
        experience_columns: Sequence[str],
        experience_count: int | None = None,
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = False,
        use_batch_seqlen_balance: bool = False,
        *,
        timeout: float | None = None,
    ) -> tuple[TensorDict | None, list[int] | None]:
        """Rows for ``consumer``: ``(TensorDict of the columns, row indexes)`` or ``(None, None)``.

        Without ``indexes``: ``experience_count`` ready rows the consumer has not consumed (whole
        prompts with ``get_n_samples``), claimed atomically; ``(None, None)`` if too few are
        ready, at once (``timeout=None``, as MindSpeed-RL) or after waiting up to ``timeout``
        seconds on the dock's event stream. With ``indexes``: those rows, marked consumed,
        waiting up to ``timeout`` seconds (None: as long as it takes) for their columns.
        """
        if consumer not in self.experience_consumers:
            raise InvalidArgument(
                f"consumer {consumer!r} is not one of {self.experience_consumers}; add it with addition_consumers="
            )
        columns = self._check_columns(experience_columns)
        if indexes is not None:
            rows = self._check_indexes(indexes)
            meta = self._run(self._take_rows(consumer, rows, columns, timeout))
            return self._client.get_data(meta), rows
        count = self._check_count(experience_count, get_n_samples)
        meta = self._run(self._claim(consumer, columns, count, get_n_samples, use_batch_seqlen_balance, timeout))
        if meta is None:
            return None, None
        return self._client.get_data(meta), [int(m["dock_index"]) for m in meta.custom_meta]

    def _claim(self, consumer: str, columns: list[str], count: int, grouped: bool, balanced: bool,
               timeout: float | None) -> Op:
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
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

    def _check_count(self, count: Any, get_n_samples: bool) -> int:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidArgument(f"experience_count must be an int >= 1 without indexes, got {count!r}")
        if count > self.max_len or self.max_len % count:
            raise InvalidArgument(f"experience_count ({count}) must divide the dock's {self.max_len} rows")
        if get_n_samples and count % self.n_samples_per_prompt:
            raise InvalidArgument(
                f"get_n_samples needs experience_count ({count}) to be a multiple of n_samples_per_prompt "
                f"({self.n_samples_per_prompt})"
            )
        return count

    def _last_event(self) -> Op:
        last = yield Cmd(("XREVRANGE", self._pk.events, "+", "-", "COUNT", 1))
        return last[0][0].decode() if last else "0-0"

    def _take_rows(self, consumer: str, rows: list[int], columns: list[str], timeout: float | None) -> Op:
        """Mark rows consumed and wait until their columns are stored; their BatchMeta."""
        deadline = None if timeout is None else time.monotonic() + timeout
        keys = [str(i) for i in rows]
        while True:
            last = yield from self._last_event()
            res = yield from kv.resolve(self._ctx, self._pk, keys, False, [])
            if res is not None and min(res.ids) >= 0 and all(c in res.schemas for c in columns):
                break
            remaining = _WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"dock rows {rows[:10]} did not get columns {columns} within {timeout}s")
            yield Wait(self._pk.events, last, min(remaining, _WAIT_SLICE_S))
        yield Pipe(
            (
                Cmd(("SADD", self._pk.tasks, consumer)),
                Cmd(("BITFIELD", self._pk.cons(consumer), *[x for i in res.ids for x in ("SET", "u1", i, 1)])),
            )
        )
        return res.meta(self.partition_id, columns)

    def _claim_balanced(self, consumer: str, columns: list[str], count: int, grouped: bool) -> Op:
        """Choose a seqlen-balanced set of ready rows in the client and claim it if still free."""
        n = self.n_samples_per_prompt if grouped else 1
        want = count // n
        for _ in range(_CLAIM_RETRIES):
            _, bitmap, _ = yield FCall(
                "ready_ids", (self._pk.meta,), (consumer, int(time.time() * 1000), 0, len(columns), *columns)
            )
            ready = _bits(bitmap or b"")
            if len(ready) < count:
                return None
            units = yield from self._units(ready, n)
            if len(units) < want:
                return None
            chosen = units[:want]
            if len(units) > want and len(units) % want == 0:
                weights = yield from self._unit_lengths(units)
                if weights is not None:
                    chosen = [units[i] for i in karmarkar_karp(weights, len(units) // want)[0]]
            ids = [i for unit in chosen for i in unit]
            reply = yield FCall(
                "claim_ids", (self._pk.meta,),
                (consumer, int(time.time() * 1000), 0, len(ids), *ids, len(ids), *ids, len(columns), *columns),
            )
            if int(reply[0]) == 1:
                return self._claimed(reply[2], reply[3], reply[4])
        return None

    def _claimed(self, ids: list, schemas: list, tags: list) -> BatchMeta:
        names = [n.decode() if isinstance(n, bytes) else n for n in schemas[::2]]
        custom: list[dict[str, Any]] = [{} for _ in ids]
        for name, values in zip(tags[::2], tags[1::2]):
            for row, raw in zip(custom, values):
                if raw is not None:
                    row[name.decode() if isinstance(name, bytes) else name] = json.loads(raw)
        return BatchMeta.from_columns(
            [int(i) for i in ids], self.partition_id,
            {n: codec.to_batchmeta_schema(json.loads(s)) for n, s in zip(names, schemas[1::2])},
            production_status=1, custom_meta=custom,
        )

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

    def _unit_lengths(self, units: list[list[int]]) -> Op:
        """``prompt_length + response_length`` per unit, or None if those are not stored for all."""
        ids = [i for unit in units for i in unit]
        schemas = yield Cmd(("HMGET", self._pk.fields, *SEQLEN_COLUMNS))
        if any(s is None for s in schemas):
            return None
        bitfield = [x for i in ids for x in ("GET", "u1", i)]
        produced = yield Pipe(tuple(Cmd(("BITFIELD", self._pk.prod(c), *bitfield)) for c in SEQLEN_COLUMNS))
        if not all(all(bits) for bits in produced):
            return None
        meta = BatchMeta.from_columns(
            ids, self.partition_id,
            {c: codec.to_batchmeta_schema(json.loads(s)) for c, s in zip(SEQLEN_COLUMNS, schemas)},
            production_status=1,
        )
        td = yield from ops.get_data(self._ctx, meta)
        per_id = {}
        for pos, sid in enumerate(ids):
            per_id[sid] = sum(float(td[c][pos].sum()) for c in SEQLEN_COLUMNS)
        return [sum(per_id[i] for i in unit) for unit in units]

    # -- state -------------------------------------------------------------------------------

    def all_consumed(self, consumer: str) -> bool:
        """True once every one of the dock's rows exists and ``consumer`` has consumed it."""
        state = self._run(streaming.progress(self._ctx, self.partition_id, consumer, []))
        return state.alive == self.max_len and state.pending == 0

    def get_experience_len(self) -> int:
        """Rows of the dock (``prompts_num * n_samples_per_prompt``)."""
        return self.max_len

    def clear(self) -> None:
        """Drop every row, column and consumer status (start the next step)."""
        self._client.clear_partition(self.partition_id)

    def close(self) -> None:
        """Close this process's connection (the dock stays)."""
        self._client.close()
