"""The ``transfer_queue`` alias: code written for the reference system runs on tq-redis unchanged.

``install_transfer_queue_alias()`` registers a ``transfer_queue`` package in ``sys.modules`` whose
public names are tq-redis objects, so ``import transfer_queue as tq`` (and the submodules the
reference's tests and verl import, listed in :data:`ALIAS_MODULES`) resolve to tq-redis without
editing the importing code. ``transfer_queue.__version__`` is :data:`REFERENCE_API_LEVEL`, the
reference release whose public API we implement.

Ways to install it:

* in-process: ``tq_redis.install_transfer_queue_alias()`` before the first ``import transfer_queue``;
* Ray workers of a cluster you start:
  ``ray.init(runtime_env={"worker_process_setup_hook": "tq_redis.integrations.alias.install_transfer_queue_alias"})``;
* any subprocess (and the workers of a Ray cluster started afterwards): put the directory printed by
  ``python -m tq_redis.integrations.alias --pythonpath`` on ``PYTHONPATH``; it holds only a tiny
  ``transfer_queue`` stub that installs the alias when imported.
  ``install_transfer_queue_alias(propagate=True)`` does that for the current process's children.

The alias package's resources are ``tq_redis/integrations/alias_files`` (its ``config.yaml``:
tq-redis's defaults in the reference's config shape). ``transfer_queue.init``/``close`` and the
controller actor the reference's tests look for are in :mod:`tq_redis.integrations.controller`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import threading
import types
from typing import Any

from tq_redis import __version__
from tq_redis.errors import ConfigError

__all__ = ["ALIAS_MODULES", "REFERENCE_API_LEVEL", "alias_pythonpath", "install_transfer_queue_alias"]

REFERENCE_API_LEVEL = ".".join(__version__.split(".")[:3])
"""The ``transferqueue`` release whose public API tq-redis implements (the alias's ``__version__``):
the first three parts of ``tq_redis.__version__``."""


_ALIAS_MARK = "__tq_redis_alias__"
_STUB_MARK = "__tq_redis_alias_stub__"

_TOP_LEVEL_EXTRA = {
    "init": "tq_redis.integrations.controller:init",
    "close": "tq_redis.integrations.controller:close",
    "AsyncTransferQueueClient": "tq_redis.client.aio:AsyncTransferQueueClient",
}
_INTERFACE = {
    "init": "tq_redis.integrations.controller:init",
    "close": "tq_redis.integrations.controller:close",
    "get_client": "tq_redis.api.system:get_client",
    "get_metrics_endpoint": "tq_redis.api.system:get_metrics_endpoint",
    "save_checkpoint": "tq_redis.api.functions:save_checkpoint",
    "load_checkpoint": "tq_redis.api.functions:load_checkpoint",
    **{
        name: f"tq_redis.api.functions:{name}"
        for base in ("kv_put", "kv_batch_put", "kv_batch_get", "kv_batch_get_by_meta", "kv_list", "kv_clear")
        for name in (base, f"async_{base}")
    },
}
_SAMPLERS = {
    name: f"tq_redis.samplers:{name}"
    for name in ("BaseSampler", "SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler", "SeqlenBalancedSampler")
}

ALIAS_MODULES: dict[str, dict[str, str]] = {
    "transfer_queue.interface": _INTERFACE,
    "transfer_queue.client": {
        "TransferQueueClient": "tq_redis.client.blocking:TransferQueueClient",
        "AsyncTransferQueueClient": "tq_redis.client.aio:AsyncTransferQueueClient",
    },
    "transfer_queue.metadata": {
        "BatchMeta": "tq_redis.meta:BatchMeta",
        "KVBatchMeta": "tq_redis.meta:KVBatchMeta",
        "extract_field_schema": "tq_redis.meta:extract_field_schema",
    },
    "transfer_queue.sampler": _SAMPLERS,
    "transfer_queue.sampler.base": {"BaseSampler": "tq_redis.samplers:BaseSampler"},
    "transfer_queue.sampler.sequential_sampler": {"SequentialSampler": "tq_redis.samplers:SequentialSampler"},
    "transfer_queue.sampler.grpo_group_n_sampler": {"GRPOGroupNSampler": "tq_redis.samplers:GRPOGroupNSampler"},
    "transfer_queue.sampler.rank_aware_sampler": {"RankAwareSampler": "tq_redis.samplers:RankAwareSampler"},
    "transfer_queue.sampler.seqlen_balanced_sampler": {
        "SeqlenBalancedSampler": "tq_redis.samplers:SeqlenBalancedSampler",
        "get_seqlen_balanced_partitions": "tq_redis.samplers:get_seqlen_balanced_partitions",
        "karmarkar_karp": "tq_redis.samplers:karmarkar_karp",
    },
    "transfer_queue.dataloader": {
        "StreamingDataset": "tq_redis.integrations.dataloader:StreamingDataset",
        "StreamingDataLoader": "tq_redis.integrations.dataloader:StreamingDataLoader",
    },
    "transfer_queue.dataloader.streaming_dataset": {
        "StreamingDataset": "tq_redis.integrations.dataloader:StreamingDataset",
        "chunk_batch_fn": "tq_redis.integrations.dataloader:chunk_batch_fn",
        "default_fetch_batch_fn": "tq_redis.integrations.dataloader:default_fetch_batch_fn",
    },
    "transfer_queue.dataloader.streaming_dataloader": {
        "StreamingDataLoader": "tq_redis.integrations.dataloader:StreamingDataLoader",
    },
    "transfer_queue.storage": {"StorageKeyNotFoundError": "tq_redis.errors:StorageKeyNotFoundError"},
    # NeMo-RL wraps its .options; a stand-in that starts nothing (tq_redis.integrations.simple_storage)
    "transfer_queue.storage.simple_storage": {
        "SimpleStorageUnit": "tq_redis.integrations.simple_storage:SimpleStorageUnit",
    },
    "transfer_queue.utils": {},
    "transfer_queue.utils.logging_utils": {"get_logger": "tq_redis.logs:get_logger"},
    # the named actor's class (NeMo-RL's adapter sets its .options); the alias's init starts it
    "transfer_queue.controller": {
        "TransferQueueController": "tq_redis.integrations.controller:TransferQueueController",
    },
}
"""Submodule -> {public name: ``"module:attribute"`` of tq-redis} (``transfer_queue`` itself maps
every name of ``tq_redis.__all__`` plus the alias's ``init``/``close``)."""

# packages in the reference (their other submodules are internals the alias does not provide)
_PACKAGES = {"transfer_queue.storage", "transfer_queue.sampler", "transfer_queue.dataloader", "transfer_queue.utils"}

# the alias package's files (its config.yaml), found by importlib.resources.files("transfer_queue")
_FILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alias_files")

_install_lock = threading.Lock()


# ------------------------------------------------------------------------------ the alias modules


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _lazy_module(name: str, table: dict[str, str], *, package: bool) -> types.ModuleType:
    mod = types.ModuleType(name, f"tq-redis alias of the reference's {name} (see tq_redis.integrations.alias).")
    setattr(mod, _ALIAS_MARK, True)
    mod.__all__ = sorted(table)  # type: ignore[attr-defined]
    if package:
        mod.__path__ = []  # type: ignore[attr-defined]  # a package: submodules come from sys.modules

    def __getattr__(attr: str) -> Any:  # PEP 562: resolved on first use, then cached
        target = table.get(attr)
        if target is None:
            raise AttributeError(
                f"module {name!r} (the tq-redis alias of transferqueue {REFERENCE_API_LEVEL}) has no attribute "
                f"{attr!r}; only the reference's public API is provided, see tq_redis.integrations.alias.ALIAS_MODULES"
            )
        value = _resolve(target)
        setattr(mod, attr, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(mod.__dict__) | set(table))

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    mod.__dir__ = __dir__  # type: ignore[method-assign]
    return mod


def _top_level_table() -> dict[str, str]:
    import tq_redis

    table = {name: f"tq_redis:{name}" for name in tq_redis.__all__}
    table.update(_TOP_LEVEL_EXTRA)
    return table


def _files_spec() -> importlib.machinery.ModuleSpec:
    """A package spec whose resources are the files of ``tq_redis/alias_files`` (its loader reads
    files beside a nonexistent ``__init__.py``; the alias module itself is never loaded from it)."""
    spec = importlib.util.spec_from_file_location(
        "transfer_queue", os.path.join(_FILES_DIR, "__init__.py"), submodule_search_locations=[]
    )
    assert spec is not None
    return spec


def _build_modules() -> dict[str, types.ModuleType]:
    top = _lazy_module("transfer_queue", _top_level_table(), package=True)
    top.__version__ = REFERENCE_API_LEVEL  # type: ignore[attr-defined]
    top.__spec__ = _files_spec()
    mods = {"transfer_queue": top}
    for name, table in ALIAS_MODULES.items():
        is_package = name in _PACKAGES or any(other.startswith(name + ".") for other in ALIAS_MODULES)
        mods[name] = _lazy_module(name, table, package=is_package)
    for name, mod in mods.items():  # parent.child attributes, as a real import would set them
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


def _check_not_real(existing: types.ModuleType | None) -> None:
    if existing is None or getattr(existing, _ALIAS_MARK, False) or getattr(existing, _STUB_MARK, False):
        return
    where = getattr(existing, "__file__", None) or "unknown location"
    raise ConfigError(
        f"the real transfer_queue package is already imported (from {where}); install the tq-redis alias "
        f"before anything imports transfer_queue, or uninstall transferqueue (pip uninstall transferqueue)"
    )


def install_transfer_queue_alias(propagate: bool = False) -> types.ModuleType:
    """Make ``import transfer_queue`` (and its public submodules) resolve to tq-redis.

    Idempotent. Raises :class:`~tq_redis.errors.ConfigError` if a real ``transfer_queue`` is
    already imported in this process. With ``propagate=True`` the directory of a small
    ``transfer_queue`` stub is also prepended to ``PYTHONPATH`` in ``os.environ``, so child
    processes started afterwards -- including the workers of a Ray cluster that ``ray.init``
    starts afterwards -- get the alias on their first ``import transfer_queue``.

    Usable as a Ray ``worker_process_setup_hook`` (``"tq_redis.integrations.alias.install_transfer_queue_alias"``).
    Returns the ``transfer_queue`` alias module.
    """
    with _install_lock:
        current = sys.modules.get("transfer_queue")
        _check_not_real(current)
        if current is None or not getattr(current, _ALIAS_MARK, False):
            for name in [n for n in list(sys.modules) if n.startswith("transfer_queue.")]:
                _check_not_real(sys.modules[name])
            sys.modules.update(_build_modules())
        if propagate:
            _prepend_pythonpath(alias_pythonpath())
        return sys.modules["transfer_queue"]


# ------------------------------------------------------------- the stub for subprocesses / Ray

_STUB_SOURCE = f'''"""Written by tq_redis.integrations.alias: importing transfer_queue installs the tq-redis alias."""
{_STUB_MARK} = True
import tq_redis.integrations.alias as _compat

_compat.install_transfer_queue_alias()
'''


def alias_pythonpath() -> str:
    """A directory holding only a ``transfer_queue`` stub package; put it on ``PYTHONPATH``.

    Importing the stub installs the alias (and replaces the stub in ``sys.modules``). The
    directory is created on first use, per user, under the system temp directory.
    """
    root = os.path.join(tempfile.gettempdir(), f"tq-redis-alias-{os.getuid()}-{REFERENCE_API_LEVEL}")
    init_py = os.path.join(root, "transfer_queue", "__init__.py")
    try:
        with open(init_py, encoding="utf-8") as fh:
            if fh.read() == _STUB_SOURCE:
                return root
    except OSError:
        pass
    os.makedirs(os.path.dirname(init_py), exist_ok=True)
    tmp = f"{init_py}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(_STUB_SOURCE)
    os.replace(tmp, init_py)  # atomic: a concurrent reader sees the old or the new file, whole
    return root


def _prepend_pythonpath(path: str) -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tq_redis.integrations.alias", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pythonpath", action="store_true", help="print the directory to put on PYTHONPATH")
    args = parser.parse_args(argv)
    if args.pythonpath:
        print(alias_pythonpath())
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
