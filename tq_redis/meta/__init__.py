"""Batch metadata handed between producers, consumers and the storage layer: the public names.

:class:`BatchMeta` describes a batch of samples by reference (ids, partition, per-field schema,
production state, per-sample tags) without holding any tensor bytes; :class:`KVBatchMeta` is the
same idea for the key/value API, where samples are named by user keys.

Both follow the public semantics of TransferQueue 0.1.11's classes of the same names, so code
written against the reference keeps working after switching the import (``tq_redis.integrations.alias`` maps
``transfer_queue.metadata`` onto this module). Differences on purpose: errors are typed
(``tq_redis.errors``) and say what to fix; nothing is logged-and-ignored.

This package's ``__init__`` is where to import them from; each part lives in a module of its own:

* :mod:`tq_redis.meta.batch_meta` — :class:`BatchMeta` and :data:`READY`;
* :mod:`tq_redis.meta.kv_batch_meta` — :class:`KVBatchMeta`;
* :mod:`tq_redis.meta.schema_entries` — the field-schema entries (``BatchMeta.field_schema[name]``, their
  keys documented there), :func:`extract_field_schema` and :func:`field_kind`;
* :mod:`tq_redis.meta.sample_views` — the per-sample views of ``BatchMeta.samples``;
* :mod:`tq_redis.meta.meta_dicts` and :mod:`tq_redis.meta.batch_positions` — the helpers both classes share
  (per-sample tag rows and ``extra_info`` unions; positions, permutations and chunks).

The ``KIND_*`` constants an entry's ``kind`` takes are defined in :mod:`tq_redis.meta.schemas` and are
importable here.

The package also holds what the metadata plane is made of below the batch classes:
:mod:`~tq_redis.meta.keys` (every Redis key of a namespace, one function each),
:mod:`~tq_redis.meta.bitmaps` (the per-field production bitmaps), :mod:`~tq_redis.meta.schemas`
(what kind of batch a field holds and whether two puts agree), :mod:`~tq_redis.meta.dtypes` and
:mod:`~tq_redis.meta.jagged` (dtype names and ragged rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_redis.lazy import lazy_names

# public name -> the module that defines it, imported on first use: importing the key layout
# (``tq_redis.meta.keys``) in a storage node or ``tq-redis status`` must not import torch
_EXPORTS = {
    "BatchMeta": "tq_redis.meta.batch_meta",
    "KIND_JAGGED": "tq_redis.meta.schemas",
    "KIND_NDARRAY": "tq_redis.meta.schemas",
    "KIND_OBJECT": "tq_redis.meta.schemas",
    "KIND_STRIDED": "tq_redis.meta.schemas",
    "KIND_TENSOR": "tq_redis.meta.schemas",
    "KVBatchMeta": "tq_redis.meta.kv_batch_meta",
    "KeyNotInBatch": "tq_redis.errors",
    "extract_field_schema": "tq_redis.meta.schema_entries",
    "field_kind": "tq_redis.meta.schema_entries",
}

__all__ = [
    "BatchMeta",
    "KIND_JAGGED",
    "KIND_NDARRAY",
    "KIND_OBJECT",
    "KIND_STRIDED",
    "KIND_TENSOR",
    "KVBatchMeta",
    "KeyNotInBatch",
    "extract_field_schema",
    "field_kind",
]

if TYPE_CHECKING:  # what type checkers and IDEs see
    from tq_redis.errors import KeyNotInBatch
    from tq_redis.meta.batch_meta import BatchMeta
    from tq_redis.meta.kv_batch_meta import KVBatchMeta
    from tq_redis.meta.schema_entries import extract_field_schema, field_kind
    from tq_redis.meta.schemas import KIND_JAGGED, KIND_NDARRAY, KIND_OBJECT, KIND_STRIDED, KIND_TENSOR

if not TYPE_CHECKING:  # type checkers see the imports above instead, so a misspelt name is flagged
    __getattr__, __dir__ = lazy_names(globals(), _EXPORTS)
