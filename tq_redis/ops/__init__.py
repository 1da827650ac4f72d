"""The operations: each written once as a generator of effects, run by both clients.

An operation validates its input, yields effects (:mod:`tq_redis.ops.effects`: Redis calls, one
atomic Lua function per state transition, and blocking store I/O) and returns the result. Order of
work follows the invariants of the architecture: bytes are stored *before* the bits that make them
visible, and bits are cleared *before* bytes are deleted. The clients run them (``client.run(op)``
/ ``await client.arun(op)``), and facades build their own on ``client.context``.

This package's ``__init__`` is where to import the core operations from (``from tq_redis import
ops; ops.get_meta(...)``); each lives in a module of its own:

* :mod:`~tq_redis.ops.effects` -- what operations yield; :mod:`~tq_redis.ops.transitions` -- one
  typed wrapper per Lua function of ``tq_redis/lua``;
* :mod:`~tq_redis.ops.context` -- :data:`Op`, :class:`Context`, the namespace's :func:`storage`
  manager and recorded settings (:func:`write_config`), :func:`canonical` schema JSON;
* :mod:`~tq_redis.ops.data` -- :func:`put` (insert or rewrite), :func:`set_custom_meta`,
  :func:`get_data`: the operations that move bytes; :mod:`~tq_redis.ops.partial` --
  :func:`append_parts`, :func:`complete_parts` (partial rollout) and the :func:`get_data` that
  reads fields written in parts too;
* :mod:`~tq_redis.ops.claim` -- :func:`get_meta` (claims with built-in or user samplers, and
  waiting), :func:`claim_choice`, :func:`settle`, :func:`reset_consumption`; beside it
  :mod:`~tq_redis.ops.claim_plan` -- the claim script's sampler options built from
  ``sampling_config`` (:func:`~tq_redis.ops.claim_plan.builtin_plan`);
* :mod:`~tq_redis.ops.batch` -- :func:`get_meta_and_data`: a claim that returns its inline values;
* :mod:`~tq_redis.ops.clear` -- :func:`clear_samples`, :func:`clear_partition` and the trash;
* :mod:`~tq_redis.ops.status` -- production and consumption status, the partition list;
* :mod:`~tq_redis.ops.kv` (the KV API), :mod:`~tq_redis.ops.streaming` (sealed partitions, drained
  reads), :mod:`~tq_redis.ops.checkpoint` (a checkpoint's record format; the client's
  :mod:`tq_redis.client.checkpoint` reads and writes it), :mod:`~tq_redis.ops.channel` with
  :mod:`~tq_redis.ops.channel_rules` (RLinf's channels);
* :mod:`~tq_redis.ops.arguments` (the checks calls share), :mod:`~tq_redis.ops.script_budget` (how
  much one script call may do), :mod:`~tq_redis.ops.data_parser` (a user's put hook).

Modules of this package import each other directly, never this ``__init__``; the import contract
(``lint-imports``) keeps them free of cycles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_redis.lazy import lazy_names

# public name -> the module that defines it, imported on first use: importing one module of the
# package (``tq_redis.ops.effects``, say) must not import every operation, and torch with them
_EXPORTS = {
    "CLEAR_COST": "tq_redis.ops.clear",
    "ChoiceClaim": "tq_redis.ops.claim",
    "Chooser": "tq_redis.ops.claim",
    "Context": "tq_redis.ops.context",
    "MODES": "tq_redis.ops.claim",
    "Op": "tq_redis.ops.context",
    "USER_SAMPLER_ATTEMPTS": "tq_redis.ops.claim",
    "canonical": "tq_redis.ops.context",
    "claim_choice": "tq_redis.ops.claim",
    "clear_partition": "tq_redis.ops.clear",
    "clear_samples": "tq_redis.ops.clear",
    "consumption_status": "tq_redis.ops.status",
    "delete_bytes": "tq_redis.ops.clear",
    "discard_bytes": "tq_redis.ops.clear",
    "empty_trash": "tq_redis.ops.clear",
    "append_parts": "tq_redis.ops.partial",
    "complete_parts": "tq_redis.ops.partial",
    "get_data": "tq_redis.ops.partial",
    "get_meta": "tq_redis.ops.claim",
    "get_meta_and_data": "tq_redis.ops.batch",
    "get_partition_list": "tq_redis.ops.status",
    "production_status": "tq_redis.ops.status",
    "put": "tq_redis.ops.data",
    "reset_consumption": "tq_redis.ops.claim",
    "set_custom_meta": "tq_redis.ops.data",
    "settle": "tq_redis.ops.claim",
    "storage": "tq_redis.ops.context",
    "write_config": "tq_redis.ops.context",
}

__all__ = [
    "CLEAR_COST",
    "ChoiceClaim",
    "Chooser",
    "Context",
    "MODES",
    "Op",
    "USER_SAMPLER_ATTEMPTS",
    "append_parts",
    "canonical",
    "claim_choice",
    "clear_partition",
    "clear_samples",
    "complete_parts",
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

if TYPE_CHECKING:  # what type checkers and IDEs see
    from tq_redis.ops.batch import get_meta_and_data
    from tq_redis.ops.claim import (
        MODES,
        USER_SAMPLER_ATTEMPTS,
        ChoiceClaim,
        Chooser,
        claim_choice,
        get_meta,
        reset_consumption,
        settle,
    )
    from tq_redis.ops.clear import CLEAR_COST, clear_partition, clear_samples, delete_bytes, discard_bytes, empty_trash
    from tq_redis.ops.context import Context, Op, canonical, storage, write_config
    from tq_redis.ops.data import put, set_custom_meta
    from tq_redis.ops.partial import append_parts, complete_parts, get_data
    from tq_redis.ops.status import consumption_status, get_partition_list, production_status

if not TYPE_CHECKING:  # type checkers see the imports above instead, so a misspelt name is flagged
    __getattr__, __dir__ = lazy_names(globals(), _EXPORTS)
