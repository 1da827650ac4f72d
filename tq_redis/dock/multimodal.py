"""``MMGRPOTransferDock``: MindSpeed-RL's multimodal dock, with its state in Redis.

MindSpeed-RL builds it beside the GRPO dock for every multimodal run
(``mindspeed_rl/trainer/utils/mm_transfer_dock.py``); this class has its constructor,
``MMGRPOTransferDock(prompts_num, n_samples_per_prompt, reuse_image_embeds=False, timeout=None,
timeout_interval=None)``, then ours, keyword-only (``redis_url=``, ``namespace=``, ``name=``, as
every dock), and the methods its workers call: ``get_columns(consumer)``,
``put_experience(batch=, indexes=)``, ``get_experience(consumer, experience_columns, indexes,
get_n_samples)``, ``get_experience_dict(experience_columns, indexes, get_n_samples)`` and ``clear()``,
plus the base class's (``get_experience_data``, ``get_experience_status``, ``get_experience_len``).

Layout. The dock has one row per *prompt* (``prompts_num`` rows): the images, videos and their
processed forms are the same for the ``n_samples_per_prompt`` responses of a prompt. Row ``p`` is the
KV key ``str(p)`` of the partition ``dock.<name>``, tagged ``uid = dock_index = p``; its columns
(:data:`MM_EXPERIENCE_COLUMNS`) are fields. A column's rows may each have their own shape (an image
of its own size, a prompt's own number of patches): tensor rows sharing a shape are stored dense,
rows of one rank but different shapes as a strided nested tensor, and non-tensor rows (``labels``
strings, ``image_num`` ints) as a list of values. Every write is one ``kv_batch_put`` of the public
client (its scripts), a clear is ``clear_partition`` plus ``lua/dock_reset.lua``; the dock writes
nothing to Redis itself.

Reads take sample-level row indexes, as the GRPO dock hands them out: with ``get_n_samples`` only
every ``n_samples_per_prompt``-th index is kept (a whole prompt's responses, one prompt), and
each index ``i`` names prompt ``i // n_samples_per_prompt``. ``get_experience`` merges the rows as
MindSpeed does: ``labels`` as a list, ``image_num`` / ``video_num`` / ``video_fps`` as an ``[rows, 1]``
tensor, ``image`` / ``video`` concatenated along dim 1, every other column along dim 0;
``get_experience_dict`` returns ``{column: [row value, ...]}``.

Differences from MindSpeed-RL on purpose:

* A read waits until its rows' columns are put (on the partition's event stream; a warning after
  ``timeout`` seconds and every ``timeout_interval`` after, as the base dock's reads do), so a read
  that overtakes a put sent with ``.remote()`` and not awaited gets the data instead of ``None``
  rows or a ``TypeError`` from ``torch.concat``; ``timeout=`` (ours) bounds the wait
  (``TimeoutError``).
* Row index -2 (the padding a partial-rollout claim of the GRPO dock adds) repeats the row before
  it, as that claim's padding does; MindSpeed reads it as a row counted from the end.
* Bad input raises a typed error (:mod:`tq_redis.errors`): a row outside the dock, the same row
  twice in one column of a put (MindSpeed keeps the last silently), fewer indexes than rows, an
  unknown column in a read, rows of one column that cannot be stored together (tensors of
  different rank or dtype, tensors mixed with other values). Columns that are not the dock's are
  ignored by ``put_experience``, as in MindSpeed (its workers put whole step outputs); ``None``
  rows are not written (MindSpeed's "not put").
* ``put_experience`` also accepts a ``TensorDict`` (its rows are the first dimension).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import torch
from tensordict import TensorDict

from tq_redis import ops
from tq_redis.dock.aging import PAD_INDEX
from tq_redis.dock.base import DockPlace, TransferDock, int_at_least
from tq_redis.errors import BatchSizeMismatch, InvalidArgument
from tq_redis.ops import transitions

MM_EXPERIENCE_COLUMNS = (
    "image", "pixel_values", "image_grid_thw", "image_shape", "labels", "vit_embeds", "position_ids",
    "image_num", "video", "video_shape", "video_fps", "video_num",
)
"""The dock's columns, as MindSpeed-RL names them."""

_MEDIA = ("image", "image_shape", "image_num", "video", "video_shape", "video_fps", "video_num")
_PIXELS = ("pixel_values", "image_grid_thw", "image_num", "video_num")
_EMBEDS = ("vit_embeds", "image_grid_thw", "image_num", "video_num")
_COUNT_COLUMNS = ("image_num", "video_num", "video_fps")  # merged into an [rows, 1] tensor
_DIM1_COLUMNS = ("image", "video")  # flattened media: concatenated along dim 1


def consumer_columns(reuse_image_embeds: bool) -> dict[str, list[str]]:
    """MindSpeed-RL's consumer -> columns map (with ``reuse_image_embeds``: the ViT's embeddings
    replace the pixel values, and ``actor_image_embeds`` computes them)."""
    columns = {
        "actor_rollout": list(_MEDIA),
        "dynamic_sampling": list(_PIXELS),
        "actor_log_prob": list(_PIXELS),
        "ref_log_prob": list(_PIXELS),
        "actor_train": list(_PIXELS),
        "rule_reward": ["labels"],
    }
    if reuse_image_embeds:
        columns["actor_image_embeds"] = list(_PIXELS)
        for consumer in ("actor_rollout", "actor_log_prob", "ref_log_prob", "actor_train"):
            columns[consumer] = list(_EMBEDS)
    return columns


def _column_rows(name: str, value: Any) -> list[Any]:
    """A put's column as its rows: a tensor's first dimension, or the items of a list."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.ndim else [value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):  # NonTensorStack, ndarray
        return list(value.tolist())
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise InvalidArgument(f"put_experience: column {name!r} must be a tensor or a list of rows (one per index)")


def mm_field(name: str, rows: list[Any]) -> Any:
    """One column's rows as a field: dense when every tensor row has one shape, a strided nested
    tensor when they share rank and dtype only, a list when no row is a tensor."""
    tensors = [isinstance(r, torch.Tensor) for r in rows]
    if not any(tensors):
        return rows
    if not all(tensors):
        raise InvalidArgument(
            f"put_experience: column {name!r} mixes tensor rows with other values; give every row as a tensor"
        )
    first = rows[0]
    if all(r.shape == first.shape and r.dtype == first.dtype for r in rows):
        return torch.stack(rows)
    if any(r.ndim != first.ndim or r.dtype != first.dtype or r.ndim == 0 for r in rows):
        raise InvalidArgument(
            f"put_experience: the rows of column {name!r} differ in rank or dtype "
            f"({sorted({(r.ndim, str(r.dtype)) for r in rows})}); each row needs the same number of "
            f"dimensions and one dtype (their sizes may differ)"
        )
    return torch.nested.nested_tensor(rows)


def _field_rows(value: Any) -> list[Any]:
    """A read field's per-row values (tensors, or the values of a list field)."""
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return list(value)


def merge_rows(column: str, rows: list[Any]) -> Any:
    """A column's rows merged as MindSpeed-RL's multimodal dock returns them."""
    if column == "labels":
        return rows
    if column in _COUNT_COLUMNS:
        return torch.cat([torch.as_tensor(r).reshape(-1) for r in rows]).reshape(-1, 1)
    tensors = [torch.atleast_1d(torch.as_tensor(r)) for r in rows]
    return torch.cat(tensors, dim=1 if column in _DIM1_COLUMNS else 0)


class MMGRPOTransferDock(TransferDock):
    """The multimodal experience of a GRPO step, with MindSpeed-RL's ``MMGRPOTransferDock`` API.

    Args:
        prompts_num: prompts per step; the dock has one row per prompt.
        n_samples_per_prompt: responses per prompt: reads map a sample's row index ``i`` to prompt
            ``i // n_samples_per_prompt``.
        reuse_image_embeds: consumers read the ViT's ``vit_embeds`` instead of ``pixel_values``
            (and ``actor_image_embeds`` is a consumer), as in MindSpeed.
        timeout / timeout_interval: a read waiting for its rows logs a warning after ``timeout``
            seconds (None: 300) and then every ``timeout_interval`` seconds (None: 5).
        The keyword-only ``**place`` (:class:`~tq_redis.dock.base.DockPlace`): ``redis_url`` /
            ``namespace`` (where the dock lives), ``name`` (the dock to attach to; None: a new,
            empty one), ``layout`` (unused here: rows come back merged as MindSpeed merges them).
    """

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int,
        reuse_image_embeds: bool = False,
        timeout: float | None = None,
        timeout_interval: float | None = None,
        **place: Unpack[DockPlace],
    ) -> None:
        samples = int_at_least("n_samples_per_prompt", n_samples_per_prompt, 1)
        self.reuse_image_embeds = bool(reuse_image_embeds)
        self.consumer_columns = consumer_columns(self.reuse_image_embeds)
        # one row per prompt, as MindSpeed's base dock gets n_samples_per_prompt=1
        super().__init__(prompts_num, 1, MM_EXPERIENCE_COLUMNS, timeout, timeout_interval, **place)
        self.n_samples_per_prompt = samples
        self._spec = ((prompts_num, n_samples_per_prompt, reuse_image_embeds, timeout, timeout_interval),
                      self._where())

    def _row_tags(self, row: int) -> dict[str, int]:
        return {"uid": row, "dock_index": row}  # a row is a prompt

    # -- columns -----------------------------------------------------------------------------

    def get_columns(self, consumer: str | None) -> list[str]:
        """The columns ``consumer`` reads, once each of them is put for some row; else ``[]``
        (also for a consumer the dock does not know, or None)."""
        columns = self.consumer_columns.get(consumer) if isinstance(consumer, str) else None
        if not columns:
            return []
        status = self._column_status(columns)
        if not all(bool(status[c].any()) for c in columns):
            return []
        return list(columns)

    # -- put ---------------------------------------------------------------------------------

    def put_experience(self, batch: Mapping[str, Any], indexes: Sequence[int] | None = None) -> None:
        """Write the dock's columns of ``batch`` into the rows (prompts) ``indexes``.

        ``batch`` maps column -> rows (a tensor, one row per index along its first dimension, or a
        list); row ``k`` of a column goes to row ``indexes[k]`` (``indexes`` may be longer than a
        column, as MindSpeed's trainer passes them). Columns that are not the dock's are ignored
        and ``None`` rows are not written, as in MindSpeed. Everything is checked before the first write.
        """
        if not hasattr(batch, "items"):
            raise InvalidArgument(f"put_experience: batch must be a dict or TensorDict of columns, got {type(batch)}")
        known = [(str(c), v) for c, v in batch.items() if c in self.experience_columns and v is not None]
        if not known:
            return
        if indexes is None:
            raise InvalidArgument("put_experience: pass indexes=, the rows (prompts) the batch's rows go to")
        if isinstance(indexes, torch.Tensor):
            indexes = indexes.tolist()
        groups: dict[tuple[int, ...], dict[str, list[Any]]] = {}
        for column, value in known:
            rows = _column_rows(column, value)
            if len(rows) > len(indexes):
                raise BatchSizeMismatch(
                    f"put_experience: column {column!r} holds {len(rows)} rows but only {len(indexes)} "
                    f"indexes are given"
                )
            pairs = [(indexes[k], r) for k, r in enumerate(rows) if r is not None]
            if not pairs:
                continue
            at = tuple(self._check_indexes([i for i, _ in pairs]))
            groups.setdefault(at, {})[column] = [r for _, r in pairs]
        writes = [  # every column checked and built before the first write
            (at, TensorDict({c: mm_field(c, rows) for c, rows in columns.items()}, batch_size=[len(at)]))
            for at, columns in groups.items()
        ]
        for at, fields in writes:
            self._client.kv_batch_put([str(i) for i in at], self.partition_id, fields, [self._row_tags(i) for i in at])

    # -- get ---------------------------------------------------------------------------------

    def _prompts(self, indexes: Sequence[int], get_n_samples: bool) -> list[int]:
        """Sample-level row indexes as prompt rows (MindSpeed's mapping; -2 repeats the row before)."""
        if isinstance(indexes, torch.Tensor):
            indexes = indexes.tolist()
        try:
            picked = [int(i) for i in (indexes[::self.n_samples_per_prompt] if get_n_samples else indexes)]
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"indexes must be a list of row numbers, got {indexes!r:.80}") from exc
        prompts: list[int] = []
        for i in picked:
            if i == PAD_INDEX and prompts:
                prompts.append(prompts[-1])
            elif i < 0:
                raise InvalidArgument(f"index {i} is not a row (only -2, a claim's padding, may follow a row)")
            else:
                prompts.append(i // self.n_samples_per_prompt)
        return prompts

    def _read(self, experience_columns: Sequence[str], indexes: Sequence[int], get_n_samples: bool,
              timeout: float | None) -> dict[str, list[Any]]:
        columns = self._check_columns(experience_columns)
        prompts = self._prompts(indexes, get_n_samples)
        if not columns or not prompts:
            return {c: [] for c in columns}
        rows = self._check_indexes(prompts, unique=False)
        meta = self._run(self._read_rows(rows, columns, timeout))
        td = self._client.get_data(meta)
        return {c: _field_rows(td.get(c)) for c in columns}

    def get_experience(
        self,
        consumer: str,
        experience_columns: Sequence[str],
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = True,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The rows of ``indexes`` (sample-level, as the GRPO dock hands them out), merged per column.

        ``{}`` without ``indexes``. With ``get_n_samples`` every ``n_samples_per_prompt``-th index
        is kept; index ``i`` reads prompt ``i // n_samples_per_prompt``. ``consumer`` names the
        stage (MindSpeed's call shape; nothing is marked consumed, as in MindSpeed). Waits until the
        rows' columns are put (``timeout`` seconds at most; None: as long as it takes).
        """
        if indexes is None:
            return {}
        got = self._read(experience_columns, indexes, get_n_samples, timeout)
        if not any(got.values()):
            return {}  # no rows named (MindSpeed's concat of nothing would raise)
        return {c: merge_rows(c, rows) for c, rows in got.items()}

    def get_experience_dict(
        self,
        experience_columns: Sequence[str],
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = True,
        *,
        timeout: float | None = None,
    ) -> dict[str, list[Any]]:
        """As :meth:`get_experience`, unmerged: ``{column: [row value, ...]}`` (what
        ``put_experience`` of another multimodal dock takes back)."""
        if indexes is None:
            return {}
        return self._read(experience_columns, indexes, get_n_samples, timeout)

    # -- clear -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every row and column (the dock's shape stays; start the next step)."""

        def op() -> Iterator[Any]:
            yield from ops.clear_partition(self._ctx, self.partition_id)
            yield from transitions.dock_reset(self._pk).call()

        self._run(op())
