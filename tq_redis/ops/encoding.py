"""How values cross into and out of the Lua library: tags, schema replies, text, id ranges, the clock.

Tags are stored as compact JSON (:func:`encode_tag` on the way in, :func:`tag_rows` for a batch's
tags on the way out, one ``json.loads`` per tag column); replies come back as bytes or str
(:func:`text`); id sets are shown as ranges in messages and logs (:func:`id_ranges`). Used by the
typed transition wrappers (:mod:`tq_redis.ops.transitions`) and by the operations that read
replies themselves.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_redis import names
from tq_redis.errors import UnsupportedValue

__all__ = ["clock_ms", "encode_tag", "id_ranges", "schema_pairs", "tag_rows", "text"]


def clock_ms(given: int | None = None) -> int:
    """The client clock in milliseconds (``given`` instead, when a caller passes a time), for what
    it only labels (a partition's creation time); lease deadlines are the server's time, read
    inside the scripts."""
    return int(time.time() * 1000) if given is None else given


def text(value: Any) -> str:
    """A reply element (bytes from redis-py) as ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)


def id_ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (sorted first): compact ids for a Lua argument."""
    out: list[str] = []
    ordered = sorted(ids)
    start = prev = ordered[0]
    for i in ordered[1:]:
        if i != prev + 1:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = i
        prev = i
    out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    # a tensor can only come from a process that imported torch: the CLI's reads never load it
    torch = sys.modules.get("torch")
    if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
        return value.tolist()
    raise UnsupportedValue(f"custom meta value {value!r} ({type(value).__name__}) is not JSON-serialisable")


def encode_tag(value: Any) -> str:
    """A tag (custom meta) value as the JSON text ``set_tags`` stores.

    Raises:
        UnsupportedValue: the value has no JSON form (bytes, objects, tuple keys, a cycle ...).
    """
    try:
        return json.dumps(value, default=_json_default, separators=(",", ":"))
    except UnsupportedValue:
        raise
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnsupportedValue(
            f"custom meta value {value!r:.120} is not JSON-serialisable ({exc}); use str keys and "
            f"JSON values (None, bool, int, float, str, list, dict)"
        ) from None


def _pairs(flat: Sequence[Any]) -> list[tuple[str, Any]]:
    return [(text(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]


def schema_pairs(flat: Sequence[Any]) -> dict[str, str]:
    """``{field: schema JSON}`` from a reply's flat ``{field, schema, ...}`` (fields without a
    registered schema, ``false`` in Lua, are left out)."""
    return {name: text(schema) for name, schema in _pairs(flat) if schema}


def tag_rows(flat: Sequence[Any], n: int) -> list[dict[str, Any]]:
    """Per-sample tag dicts from a reply's flat ``{name, [JSON or nil per sample], ...}``.

    Each tag column is decoded with one ``json.loads`` of the joined values (a batch of 1024
    with a few tags would otherwise spend milliseconds in per-value ``json.loads`` calls). Tags of
    tq-redis's own (:func:`tq_redis.names.is_reserved`: partial rollout's ``<f>~parts``, ``<f>~next``)
    are left out: no user may write them, so a batch read and written back never carries them."""
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, values in _pairs(flat):
        if names.is_reserved(name):
            continue
        present = [i for i, raw in enumerate(values) if raw is not None]
        if not present:
            continue
        raws = [values[i] for i in present]
        try:
            if isinstance(raws[0], bytes):
                decoded = json.loads(b"[" + b",".join(raws) + b"]")
            else:
                decoded = json.loads("[" + ",".join(raws) + "]")
        except (TypeError, ValueError):  # a value not written by set_tags: one at a time
            decoded = [json.loads(raw) for raw in raws]
        if len(decoded) != len(present):  # e.g. a value holding a bare "1,2": one at a time
            decoded = [json.loads(raw) for raw in raws]
        for i, value in zip(present, decoded):
            rows[i][name] = value
    return rows
