"""Every Redis key tq-redis uses, built in one place.

Layout (``ns`` is the namespace, ``p`` the partition id; ``{p}`` is a Redis Cluster hash tag, so
every key of one partition lives in one slot and each script touches a single slot):

=================================  ======  ===============================================
key                                type    holds
=================================  ======  ===============================================
``ns:partitions``                  ZSET    partition ids, scored by creation time
``ns:config``                      HASH    namespace settings written by ``init`` (store, sampler)
``ns:storage:nodes``               HASH    storage-node id -> JSON (address, capacity, used, heartbeat)
``ns:{p}:meta``                    HASH    partition info: created_ms, samples, sealed
                                           (and ``dock_cursor``: next free row of a GRPOTransferDock)
``ns:{p}:seq``                     STRING  next sample id (survives clears: ids never reused)
``ns:{p}:alive``                   BITMAP  bit i set while sample i exists
``ns:{p}:fields``                  HASH    field name -> schema JSON (kind, dtype, shape, store)
``ns:{p}:prod:<field>``            BITMAP  bit i set once field is stored for sample i
``ns:{p}:tasks``                   SET     consumer task names seen in this partition
``ns:{p}:cons:<task>``             BITMAP  bit i set once sample i was handed to the task
``ns:{p}:lease:<task>``            ZSET    sample id -> lease deadline (ms) of in-flight samples
``ns:{p}:dlv:<task>``              HASH    sample id -> delivery count (lease mode)
``ns:{p}:poison:<task>``           SET     sample ids moved aside after max deliveries
``ns:{p}:tagnames``                SET     names of per-sample tags in use
``ns:{p}:tag:<name>``              HASH    sample id -> JSON value of tag ``name``
``ns:{p}:groups``                  HASH    first id of an insert -> group size (GRPO groups)
``ns:{p}:groupidx``                ZSET    first id of every insert (sorted mirror of groups)
``ns:{p}:rank:<task>:<dp>:<b>``    STRING  ids RankAwareSampler chose for a DP group's batch (TTL)
``ns:{p}:bal:<task>:<b>``          STRING  SeqlenBalancedSampler's per-rank parts "ids;ids;..." (TTL)
``ns:{p}:tmp:*``                   any     scratch keys of a script, deleted before it returns
``ns:{p}:kv``                      HASH    user key -> sample id (KV API)
``ns:{p}:kvkeys``                  HASH    sample id -> user key (KV API, reverse of ``kv``)
``ns:{p}:events``                  STREAM  insert / produced / released / cleared events
``ns:{p}:waittasks``               SET     tasks with consumers waiting in ``get_meta`` (expires)
``ns:{p}:waiters:<task>``          ZSET    waiting consumer id -> deadline (ms); expires
``ns:{p}:wake:<task>``             LIST    wake tokens: one waiter BLPOPs each (expires)
``ns:{p}:wakebudget:<task>``       STRING  wakes left for waiters passing on unused samples (expires)
``ns:{p}:trash``                   BITMAP  bit i set while sample i's bytes still await deletion
``ns:{p}:trashfields``             SET     fields the trashed samples may hold bytes for
``ns:{p}:d:<id>:<field>``          STRING  tensor bytes (only with the ``redis`` inline store)
``ns:{p}:dock``                    HASH    prompts_num, n_samples_per_prompt of a GRPOTransferDock
                                           (kept across clears)
``ns:{p}:dockstate``               HASH    ``cur_index``: the dock's prefetch_request_index cursor
``ns:{p}:dockmetrics``             LIST    the dock's update_metrics entries, replayed by get_metrics
``ns:chan:{c}:meta``               HASH    channel ``c``: maxsize, created_ms, ``w:<key>`` summed weights
``ns:chan:{c}:seq``                STRING  next data-plane id of a tensor item put in the channel
``ns:chan:{c}:q:<key>``            LIST    FIFO of entries ``"<weight>|<payload>"`` of queue ``key``
``ns:chan:{c}:puts``               STREAM  one event per put (wakes blocked ``get``/``get_batch``)
``ns:chan:{c}:gets``               STREAM  one event per get of a bounded channel (wakes blocked ``put``)
``ns:{__chan__.c}:d:<id>:<field>`` STRING  bytes of tensor / TensorDict items of channel ``c`` (redis store)
=================================  ======  ===============================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tq_redis.errors import InvalidArgument

_FORBIDDEN = set("{}\r\n ")


def check_name(kind: str, value: str) -> str:
    """Validate a partition / field / task name so it cannot break the key layout."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{kind} must be a non-empty string, got {value!r}")
    bad = _FORBIDDEN.intersection(value)
    if bad:
        raise InvalidArgument(
            f"{kind} {value!r} contains {''.join(sorted(bad))!r}; use letters, digits, '_', '-', '.', ':' or '/'"
        )
    return value


def partitions_key(ns: str) -> str:
    return f"{ns}:partitions"


def config_key(ns: str) -> str:
    return f"{ns}:config"


def storage_nodes_key(ns: str) -> str:
    """HASH of registered storage nodes: node id -> JSON description (see ``backends/dram``)."""
    return f"{ns}:storage:nodes"


class _Key:
    """A key of the owner's prefix: ``obj.<name>`` is ``obj.prefix + suffix``."""

    def __init__(self, suffix: str, doc: str | None = None) -> None:
        self.suffix = suffix
        self.__doc__ = doc or f"``<prefix>{suffix}``"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.prefix + self.suffix


class _KeyOf:
    """A family of keys of the owner's prefix: ``obj.<name>(x)`` is ``obj.prefix + suffix + x``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.__doc__ = f"``<prefix>{suffix}<name>``"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        head = obj.prefix + self.suffix
        return lambda name: head + name


class PartitionKeys:
    """Key builder for one partition; all keys share the ``{partition}`` hash tag."""

    __slots__ = ("ns", "partition", "prefix")

    def __init__(self, ns: str, partition: str) -> None:
        self.ns = ns
        self.partition = check_name("partition_id", partition)
        self.prefix = f"{ns}:{{{partition}}}:"

    meta = _Key("meta")
    seq = _Key("seq")
    alive = _Key("alive")
    fields = _Key("fields")
    tasks = _Key("tasks")
    tagnames = _Key("tagnames")
    groups = _Key("groups")
    kv = _Key("kv")
    kvkeys = _Key("kvkeys", "Reverse map of :attr:`kv`: sample id -> user key.")
    events = _Key("events")
    waittasks = _Key("waittasks")
    waiters = _KeyOf("waiters:")
    wake = _KeyOf("wake:")
    trash = _Key("trash", "Bitmap of samples whose bytes are still to be deleted from the stores.")
    trash_fields = _Key("trashfields", "Set of the field names the trashed samples may hold bytes for.")
    prod = _KeyOf("prod:")
    cons = _KeyOf("cons:")
    lease = _KeyOf("lease:")
    deliveries = _KeyOf("dlv:")
    poison = _KeyOf("poison:")
    tag = _KeyOf("tag:")

    def data(self, sample_id: int, field: str) -> str:
        """Data-plane key of one (sample, field) value; every store uses this name."""
        return f"{self.prefix}d:{sample_id}:{field}"

    def data_keys(self, sample_ids: Iterable[int], field: str) -> list[str]:
        """:meth:`data` for many samples of one field (one comprehension: batches are large)."""
        head = f"{self.prefix}d:"
        tail = f":{field}"
        return [f"{head}{i}{tail}" for i in sample_ids]


class ChannelKeys:
    """Key builder for one :class:`tq_redis.Channel`; all keys share the ``{channel}`` hash tag.

    Tensor items go through the data plane under the hidden partition :attr:`data_partition`.
    """

    __slots__ = ("ns", "name", "prefix")

    def __init__(self, ns: str, name: str) -> None:
        self.ns = ns
        self.name = check_name("channel name", name)
        self.prefix = f"{ns}:chan:{{{name}}}:"

    meta = _Key("meta")
    seq = _Key("seq")
    puts = _Key("puts")
    gets = _Key("gets")
    queue = _KeyOf("q:")

    @property
    def data_partition(self) -> str:
        """Partition id whose data-plane keys hold this channel's tensor items."""
        return f"__chan__.{self.name}"
