"""Configuration for ``tq_redis.init``: defaults, environment, and the reference system's shape.

Our own shape (every key optional)::

    redis:     {url: null,               # null and no TQ_REDIS_URL -> start an embedded Valkey
                cluster: null,           # true/false: the URL is / is not a Redis Cluster node;
                                         #   null: TQ_REDIS_CLUSTER, else ask the server (INFO cluster)
                on_eviction: error,      # error|warn: a server whose maxmemory-policy evicts any key
                                         #   (allkeys-*) is refused / only warned about
                                         #   (TQ_REDIS_ON_EVICTION; see tq_redis.server.policy)
                load_library: auto,      # auto|never: clients load the Lua library themselves / only an
                                         #   admin does (tq-redis load-library) (TQ_REDIS_LOAD_LIBRARY)
                sentinel: null,          # {hosts: [h:26379, ...], service: mymaster, db, username, password,
                                         #   sentinel_username, sentinel_password}: becomes redis.url
                                         #   redis+sentinel://... (the canonical form; see tq_redis.server.sentinel)
                durable: none,           # none | replicas[:N] | aof[:N]: WAIT / WAITAOF after every write
                durable_timeout_ms: 1000}  #   (TQ_REDIS_DURABLE[_TIMEOUT_MS]; see tq_redis.server.durability)
    namespace: tq                        # two jobs on one Redis use two namespaces
    namespace_ttl: null                  # seconds: `tq-redis namespace gc` drops the namespace once no
                                         #   client has touched it for that long (null: never)
    storage:   {backend: dram, units: 2, unit_capacity: 4GiB, spill: null, options: {},
                inline_max_bytes: 4KiB,  # spill: fsspec URL the embedded nodes overflow to
                durable: null,           # fsspec URL (or {url, storage_options}) every store value is
                                         #   also written to before a put returns (TQ_STORAGE_DURABLE;
                                         #   see tq_redis.storage.durable)
                replicas: 1}             # dram: each value on this many distinct nodes (hosts)
                                         # inline_max_bytes: a put whose every value is at most this
                                         #   keeps them in Redis with the bits (one round trip); 0: never
    sampler:   SequentialSampler         # default sampler: a name, a class or an instance
    staleness: {max_lag: null,           # the namespace's staleness bound for group reservations: every
                batch_size: 1}           #   partition without its own (set_staleness_bound) admits within
                                         #   (version + max_lag + 1) * batch_size; null: no bound
    compat:    {nested_output: true,     # the reference's layout: tensor fields come back nested;
                strict_schema: false}    #   false: a field whose samples share a shape comes back dense
                                         # strict_schema: a put whose shape/dtype differs from the
                                         #   field's first put raises instead of making it jagged
    codec:     {allow_pickle: false}     # true: pickle what the safe encoding cannot hold
    metrics:   {enabled: false, port: 0}

The reference system's config (``backend.storage_backend``, ``controller.sampler`` ...) is accepted
too; :data:`REFERENCE_KEYS` says what each of its keys becomes, or why it is ignored. Like the
reference, other top-level sections (verl's ``transfer_queue`` section carries ``enable`` ...) are
kept in the returned config and otherwise ignored; a name close to one of ours is refused as a
likely typo.
"""

from __future__ import annotations

import copy
import difflib
import sys
from collections.abc import Mapping
from typing import Any

from tq_redis.errors import ConfigError
from tq_redis.server import durability, sentinel
from tq_redis.server import policy as server_policy
from tq_redis.server.connections import check_url, parse_cluster_flag
from tq_redis.settings import settings
from tq_redis.storage.durable import durable_spec
from tq_redis.units import parse_size

DEFAULTS: dict[str, Any] = {
    "redis": {"url": None, "cluster": None, "on_eviction": None, "load_library": None,
              "sentinel": None, "durable": None, "durable_timeout_ms": None},
    "namespace": "tq",
    "namespace_ttl": None,
    "storage": {"backend": "dram", "units": 2, "unit_capacity": "4GiB", "spill": None, "options": {},
                "inline_max_bytes": "4KiB", "durable": None, "replicas": 1},
    "sampler": "SequentialSampler",
    "staleness": {"max_lag": None, "batch_size": 1},
    "compat": {"nested_output": True, "strict_schema": False},
    "codec": {"allow_pickle": False},
    "metrics": {"enabled": False, "port": 0},
}

# reference backend name -> our store name
_REFERENCE_BACKENDS = {
    "SimpleStorage": "dram",
    "MooncakeStore": "mooncake",
    "Yuanrong": "yuanrong",
    "RayStore": "ray",
}

REFERENCE_KEYS: dict[str, str] = {
    "backend.storage_backend": "storage.backend (SimpleStorage->dram, MooncakeStore->mooncake, "
    "Yuanrong->yuanrong, RayStore->ray)",
    "backend.SimpleStorage.num_data_storage_units": "storage.units",
    "backend.<store>.*": "storage.options of that store",
    "controller.sampler": "sampler",
    "controller.polling_mode": "ignored: get_meta never blocks anyone else; pass timeout= to wait",
    "controller.zmq_info": "ignored: there is no controller process",
    "backend.SimpleStorage.zmq_info": "ignored: storage nodes register themselves in Redis",
    "backend.SimpleStorage.total_storage_size": "ignored: capacity is bytes per node (storage.unit_capacity)",
    "backend.SimpleStorage.ssd_offload": "storage.spill = ssd_offload.path when ssd_offload.enabled (a full "
    "node writes its overflow there; threshold_bytes is ignored)",
    "metrics.*": "metrics.*",
}

_OUR_SECTIONS = set(DEFAULTS)
_REFERENCE_SECTIONS = {"backend", "controller"}


def to_plain(conf: Any) -> dict[str, Any]:
    """Accept a dict, an OmegaConf DictConfig or None."""
    if conf is None:
        return {}
    # OmegaConf is optional, and a DictConfig exists only where omegaconf was imported: a process
    # that passes a dict does not pay its import (a third of a second, in every rank that attaches)
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(conf, omegaconf.DictConfig):
        return omegaconf.OmegaConf.to_container(conf, resolve=True)  # type: ignore[no-any-return]
    if not isinstance(conf, Mapping):
        raise ConfigError(f"init(conf) takes a dict or an OmegaConf DictConfig, got {type(conf).__name__}")
    return copy.deepcopy(dict(conf))


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def _from_reference(conf: dict[str, Any], out: dict[str, Any]) -> None:
    backend = conf.get("backend") or {}
    name = backend.get("storage_backend")
    if name is not None:
        if name not in _REFERENCE_BACKENDS:
            raise ConfigError(
                f"backend.storage_backend={name!r} is not known; use one of {sorted(_REFERENCE_BACKENDS)} "
                f"or set storage.backend to a tq-redis store name"
            )
        out["storage"]["backend"] = _REFERENCE_BACKENDS[name]
        options = dict(backend.get(name) or {})
        if name == "SimpleStorage":
            units = options.get("num_data_storage_units")
            if units is not None:
                out["storage"]["units"] = int(units)
            offload = options.get("ssd_offload") or {}
            if offload.get("enabled"):
                if not offload.get("path"):
                    raise ConfigError(
                        "backend.SimpleStorage.ssd_offload.enabled is true but ssd_offload.path is not set; "
                        "give the directory the storage nodes spill to"
                    )
                out["storage"]["spill"] = str(offload["path"])
        else:
            options.pop("zmq_info", None)
            out["storage"]["options"] = _merge(options, out["storage"]["options"])
    controller = conf.get("controller") or {}
    if controller.get("sampler") is not None:
        out["sampler"] = controller["sampler"]


def load(conf: Any = None) -> dict[str, Any]:
    """Merge defaults, the environment (``TQ_REDIS_URL``, ``TQ_NAMESPACE``, ``TQ_REDIS_CLUSTER``,
    ``TQ_REDIS_ON_EVICTION``, ``TQ_REDIS_LOAD_LIBRARY``, ``TQ_REDIS_DURABLE[_TIMEOUT_MS]``,
    ``TQ_STORAGE_DURABLE``, ``TQ_STORAGE_REPLICAS``) and ``conf``."""
    given = to_plain(conf)
    known = _OUR_SECTIONS | _REFERENCE_SECTIONS
    unknown = sorted(str(k) for k in set(given) - known)
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"unknown config section {name!r}: did you mean {close[0]!r}?")
    out = copy.deepcopy(DEFAULTS)
    for name in unknown:  # kept as given, as the reference merges them; nothing reads them
        out[name] = given[name]
    if settings.redis_url:
        out["redis"]["url"] = settings.redis_url
    if settings.namespace:
        out["namespace"] = settings.namespace
    if settings.redis_cluster is not None:
        out["redis"]["cluster"] = settings.redis_cluster
    if settings.storage_durable:
        out["storage"]["durable"] = settings.storage_durable
    if settings.storage_replicas is not None:
        out["storage"]["replicas"] = settings.storage_replicas
    _from_reference(given, out)
    for section in _OUR_SECTIONS & set(given):
        value = given[section]
        if isinstance(DEFAULTS[section], dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config section {section!r} must be a mapping, got {value!r}")
            _merge(out[section], value)
        else:
            out[section] = value
    out["redis"]["cluster"] = parse_cluster_flag(out["redis"].get("cluster"), "redis.cluster")
    for name in ("on_eviction", "load_library"):  # None: the environment's, else the default
        value = out["redis"].get(name)
        out["redis"][name] = server_policy.setting("", name) if value is None else server_policy.parse(name, value)
    _high_availability(out["redis"], given.get("redis"))
    if out["redis"]["url"] is not None:
        check_url(out["redis"]["url"])
    out["storage"]["inline_max_bytes"] = parse_size(out["storage"]["inline_max_bytes"], allow_zero=True)
    out["storage"]["durable"] = durable_spec(out["storage"].get("durable"))
    _check_replicas(out["storage"])
    if not isinstance(out["namespace"], str) or not out["namespace"]:
        raise ConfigError(f"namespace must be a non-empty string, got {out['namespace']!r}")
    _check_staleness(out["staleness"])
    ttl = out["namespace_ttl"]
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < float("inf")):
        raise ConfigError(
            f"namespace_ttl must be a positive number of seconds (or null: never dropped), got {ttl!r}"
        )
    return out


def _check_replicas(section: dict[str, Any]) -> None:
    """``storage.replicas``: an integer >= 1; above 1 only for the ``dram`` store, and not given
    differently in ``storage.options`` too."""
    n = section.get("replicas", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"storage.replicas must be an integer >= 1 (copies of each value), got {n!r}")
    options = section.get("options") or {}
    if "replicas" in options and options["replicas"] != n and n != 1:
        raise ConfigError(
            f"storage.replicas={n} and storage.options.replicas={options['replicas']!r} disagree; give one of them"
        )
    n = options.get("replicas", n) if isinstance(options, Mapping) else n
    if n != 1 and section.get("backend") != "dram":
        raise ConfigError(
            f"storage.replicas={n} is for the dram store (its own storage nodes); the {section.get('backend')!r} "
            f"store keeps its own copies: leave storage.replicas at 1"
        )
    section["replicas"] = n


def _check_staleness(section: dict[str, Any]) -> None:
    """``staleness.max_lag``: null or an integer >= 0; ``staleness.batch_size``: an integer >= 1."""
    unknown = sorted(set(section) - {"max_lag", "batch_size"})
    if unknown:
        raise ConfigError(f"staleness takes max_lag and batch_size, not {unknown}")
    lag, batch = section["max_lag"], section["batch_size"]
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
        raise ConfigError(
            f"staleness.max_lag must be an integer >= 0 (policy versions a sample may lag) or null (no bound), "
            f"got {lag!r}"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"staleness.batch_size must be an integer >= 1 (samples trained per version), got {batch!r}")


def _high_availability(section: dict[str, Any], given: Any) -> None:
    """``redis.sentinel`` becomes ``redis.url`` (``redis+sentinel://...``, the one canonical form);
    ``redis.durable[_timeout_ms]`` is normalized (``replicas:1``), the environment's when not given."""
    block = section.get("sentinel")
    if block is not None:
        if isinstance(given, Mapping) and given.get("url") is not None:
            raise ConfigError(
                "give either redis.url or redis.sentinel, not both: redis.sentinel is turned into the URL "
                f"{sentinel.url_from_block(block)!r}"
            )
        section["url"] = sentinel.url_from_block(block)
    env = durability.from_env()
    mode, timeout = section.get("durable"), section.get("durable_timeout_ms")
    setting = durability.parse(env if mode is None else mode, timeout if timeout is not None else env.timeout_ms)
    section["durable"], section["durable_timeout_ms"] = str(setting), setting.timeout_ms
