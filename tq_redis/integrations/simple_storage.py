"""``transfer_queue.storage.simple_storage.SimpleStorageUnit`` of the alias: a stand-in, not a store.

In the reference system a job starts its storage units itself, as Ray actors
(``SimpleStorageUnit.options(num_cpus=..., ...).remote(storage_unit_size=...)``), and NeMo-RL's adapter
imports the class to wrap its ``.options`` (adding a ``runtime_env``). tq-redis's storage nodes are
started otherwise -- by ``tq.init()`` (local DRAM units), ``tq-redis up``, ``tq-redis storage-unit`` or
:func:`tq_redis.integrations.ray_placement.place_storage_nodes` -- and register themselves in Redis,
where every client finds them. So this class only keeps such code running:

* ``SimpleStorageUnit.options(**ray_options)`` accepts whatever Ray's ``.options`` takes (``num_cpus``,
  ``resources``, ``runtime_env``, ``name``, ``scheduling_strategy``, ``placement_group`` ...) and
  returns a :class:`UnitLauncher`; the class attribute may be replaced or wrapped, as NeMo-RL does;
* ``.remote(*args, **kwargs)`` (on the launcher or on the class) starts nothing and returns a
  :class:`StorageUnitStandIn` that records what it was given. Calling one of the reference unit's
  methods on it raises :class:`~tq_redis.errors.ConfigError` naming how tq-redis starts storage.
"""

from __future__ import annotations

from typing import Any

from tq_redis.errors import ConfigError
from tq_redis.reprs import attrs_repr

__all__ = ["SimpleStorageUnit", "StorageUnitStandIn", "UnitLauncher"]

_HOW = (
    "tq-redis starts its storage nodes itself (tq.init() starts local DRAM units; on a cluster: tq-redis up, "
    "tq-redis storage-unit, or tq_redis.integrations.ray_placement.place_storage_nodes) and they register in "
    "Redis, where every client finds them; a SimpleStorageUnit of the transfer_queue alias starts nothing"
)


class StorageUnitStandIn:
    """What ``SimpleStorageUnit...remote(...)`` returns: the Ray options and arguments it was given.

    It holds no data and runs no process; the reference unit's methods are not there (see the module)."""

    def __init__(self, options: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.options = dict(options)
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def __repr__(self) -> str:
        return attrs_repr(self, ("options", "kwargs"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders: a plain AttributeError
            raise AttributeError(name)
        raise ConfigError(f"SimpleStorageUnit stand-in has no {name!r}: {_HOW}")


class UnitLauncher:
    """``SimpleStorageUnit.options(...)``: the Ray options given, and ``remote`` to make a stand-in."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.ray_options = dict(options)

    def __repr__(self) -> str:
        return attrs_repr(self, ("ray_options",))

    def options(self, **options: Any) -> UnitLauncher:
        """These options added to the ones already given (Ray's ``.options`` chains the same way)."""
        return UnitLauncher({**self.ray_options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> StorageUnitStandIn:
        """Start nothing; a :class:`StorageUnitStandIn` recording the options and arguments."""
        return StorageUnitStandIn(self.ray_options, args, kwargs)


class SimpleStorageUnit:
    """The reference's storage-unit actor class, as a stand-in (see the module): ``.options(**kw)``
    accepts any Ray actor option and ``.remote(...)`` starts nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"SimpleStorageUnit is not instantiated directly: {_HOW}")

    @classmethod
    def options(cls, **options: Any) -> UnitLauncher:
        """Accept any Ray actor options (``num_cpus``, ``resources``, ``runtime_env``, ``name``,
        ``scheduling_strategy`` ...); a :class:`UnitLauncher` whose ``remote`` starts nothing."""
        return UnitLauncher(options)

    @classmethod
    def remote(cls, *args: Any, **kwargs: Any) -> StorageUnitStandIn:
        """``SimpleStorageUnit.remote(...)`` without options: a stand-in, as ``options().remote(...)``."""
        return cls.options().remote(*args, **kwargs)
