"""Client operations, each written once as a generator of effects (see :mod:`tq_redis.driver`): the public names.

An operation validates its input, yields Redis calls (one atomic Lua function per state
transition) and blocking store I/O, and returns the result. Order of work follows the
invariants of the architecture: bytes are stored *before* the bits that make them visible, and
bits are cleared *before* bytes are deleted. The clients run them (``client.run(op)`` /
``await client.arun(op)``), and facades build their own on ``client.context``.

This module is where to import them from; each part lives in a module of its own:

* :mod:`tq_redis.ops_context` — :data:`Op`, :class:`Context`, the namespace's :func:`storage`
  manager and recorded settings (:func:`write_config`), :func:`canonical` schema JSON;
* :mod:`tq_redis.ops_data` — :func:`put` (insert or rewrite), :func:`set_custom_meta` and
  :func:`get_data`: the operations that move bytes;
* :mod:`tq_redis.ops_claim` — :func:`get_meta` (claims with built-in or user samplers, and waiting),
  :func:`claim_choice` (the one ready-set-then-claim loop), :func:`settle` and
  :func:`reset_consumption`;
* :mod:`tq_redis.ops_batch` — :func:`get_meta_and_data`: a claim that returns its inline values;
* :mod:`tq_redis.ops_clear` — :func:`clear_samples`, :func:`clear_partition` and the trash
  (:func:`delete_bytes`, :func:`empty_trash`, :func:`discard_bytes`);
* :mod:`tq_redis.ops_status` — :func:`production_status`, :func:`consumption_status`,
  :func:`get_partition_list`.

Those modules import from :mod:`tq_redis.ops_context` and from each other in one direction
(``ops_context`` <- ``ops_clear`` <- ``ops_data`` <- ``ops_claim`` <- ``ops_batch``, ``ops_status`` <- ``ops_claim``);
none imports this module.
"""

from __future__ import annotations

from tq_redis.ops_batch import get_meta_and_data
from tq_redis.ops_claim import (
    MODES,
    USER_SAMPLER_ATTEMPTS,
    ChoiceClaim,
    Chooser,
    claim_choice,
    get_meta,
    reset_consumption,
    settle,
)
from tq_redis.ops_clear import CLEAR_COST, clear_partition, clear_samples, delete_bytes, discard_bytes, empty_trash
from tq_redis.ops_context import Context, Op, canonical, storage, write_config
from tq_redis.ops_data import get_data, put, set_custom_meta
from tq_redis.ops_status import consumption_status, get_partition_list, production_status
from tq_redis.transitions import id_ranges as id_ranges  # re-exported: ops.id_ranges predates transitions

__all__ = [
    "CLEAR_COST",
    "MODES",
    "USER_SAMPLER_ATTEMPTS",
    "ChoiceClaim",
    "Chooser",
    "Context",
    "Op",
    "canonical",
    "claim_choice",
    "clear_partition",
    "clear_samples",
    "consumption_status",
    "delete_bytes",
    "discard_bytes",
    "empty_trash",
    "get_data",
    "get_meta",
    "get_meta_and_data",
    "get_partition_list",
    "production_status",
    "put",
    "reset_consumption",
    "set_custom_meta",
    "settle",
    "storage",
    "write_config",
]
