"""Every Redis key tq-redis uses, built in one place, from names :mod:`tq_redis.names` checked.

Layout (``ns`` is the namespace, ``p`` the partition id, ``c`` a channel name). ``{p}`` below is
short for the Redis Cluster hash tag ``{ns/p}`` (``{c}`` for ``{ns/c}``): every key of one partition
lives in one slot, so each script touches a single slot, and the namespace inside the tag spreads
two jobs' partitions of the same name over different slots. (Before 0.2 the tag was ``{p}`` alone;
checkpoints are written without the namespace in the tag and load under either layout.)

=================================  ======  ===============================================
key                                type    holds
=================================  ======  ===============================================
``ns:partitions``                  ZSET    partition ids, scored by creation time
``ns:partitions:kept``             SET     partition ids whose keys outlive their place in ``partitions``
                                           (a cleared partition keeps ``seq`` and its trash)
``ns:channels``                    SET     channel names (what ``Channel.create`` made)
``ns:config``                      HASH    namespace settings written by ``init`` (store, sampler,
                                           ``ttl_s``), its life: ``created_ms``, ``touched_ms``, and its
                                           identity: ``epoch``, 16 hex digits drawn when it is created
                                           (a client finding it gone or changed raises
                                           ``ServerStateLost``: :mod:`tq_redis.server.identity`)
``ns:clients``                     ZSET    live client processes: ``host:pid:id`` -> when it counts as
                                           gone (ms, Redis's clock); expires with the last one
``ns:storage:nodes``               HASH    storage-node id -> JSON (address, capacity, used, heartbeat,
                                           the ``epoch`` of the namespace the node serves)
``ns:storage:epoch``               STRING  a copy of ``config``'s ``epoch`` the storage nodes may read
``ns:storage:rings``               HASH    ring id -> JSON list of [node id, address]: every set of
                                           DRAM nodes a value was put under (see ``<p>:rings``)
``ns:storage:repairs``             HASH    ring id -> JSON list of [dead node id, ring id]: where the
                                           copies a dead node held under a replicated ring were re-made
``ns:storage:repair``              HASH    the DRAM repair's state and progress (``tq-redis status``)
``ns:storage:repair:lease``        STRING  token of the one process repairing replicas now (expires)
``ns:storage:pending:<node>``      LIST    deletes a DRAM node missed while unreachable (newline-
                                           joined keys per entry); the node drains it when back
``ns:storage:pendingnodes``        SET     node ids that have a ``pending:`` list
``ns:{p}:meta``                    HASH    partition info: created_ms, samples, sealed, inlineonly
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
``ns:{p}:sampled:<task>``          HASH    sample id -> times handed to the task so far (replay:
                                           ``max_times_sampled`` > 1; dropped once it is reached)
``ns:{p}:ratelimit``               HASH    samples-per-insert rate limiters: ``inserts`` (counted while
                                           one is set), ``cfg:<task>`` (ratio, min size, error buffer,
                                           insert timeout), ``sampled:<task>`` (ids handed to the task);
                                           kept across clears and drops, like ``seq``
``ns:{p}:counters``                HASH    ``expired:<task>``, ``redelivered:<task>``, ``poison:<task>``:
                                           lease expiries, redeliveries and samples turned poison,
                                           counted by the scripts as they happen; never reset (clears,
                                           drops and ``reset_consumption`` leave it, like ``seq``)
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
``ns:{p}:tagchanges``              STREAM  one entry per tag write: ``prev`` (the entry before) and
                                           ``ids`` (ranges text); capped (~10,000); what ``kv_watch``
                                           follows; a drop leaves one ``dropped`` entry, expiring
``ns:{p}:waittasks``               SET     tasks with consumers waiting in ``get_meta`` (expires)
``ns:{p}:waiters:<task>``          ZSET    waiting consumer id -> deadline (ms); expires
``ns:{p}:waitneed:<task>``         STRING  what the waiters need before new data wakes one: the
                                           batch size and fields, tab-separated, or ``*`` (any
                                           event); expires
``ns:{p}:wake:<task>``             LIST    wake tokens: one waiter BLPOPs each (expires)
``ns:{p}:wakebudget:<task>``       STRING  wakes left for waiters passing on unused samples (expires)
``ns:{p}:trash``                   BITMAP  bit i set while sample i's bytes still await deletion
``ns:{p}:trashfields``             SET     fields the trashed samples may hold bytes for
``ns:{p}:rings``                   HASH    ring id -> index (0, 1, ...): the node sets (``storage:rings``)
                                           this partition's store values were put under; kept
                                           after a clear until its trash is empty
``ns:{p}:loc:<field>``             STRING  per sample id, 2 bytes (little-endian): the index of the
                                           ring its value of ``field`` was put under (none: 0)
``ns:{p}:closed``                  STRING  set when a sealed partition is cleared (its time, ms):
                                           puts are refused until ``reopen_partition``
``ns:{p}:inline``                   HASH    ``<id>:<field>`` -> bytes of values put inline (at most
                                           ``storage.inline_max_bytes`` each), written with the bits
``ns:{p}:d:<id>:<field>``          STRING  tensor bytes (only with the ``redis`` store)
``ns:{p}:dock``                    HASH    prompts_num, n_samples_per_prompt of a GRPOTransferDock
                                           (kept across clears)
``ns:{p}:dockstate``               HASH    ``cur_index``: the dock's prefetch_request_index cursor
``ns:{p}:dockmetrics``             LIST    the dock's update_metrics entries, replayed by get_metrics
``ns:{p}:dockdone``                STRING  bitmap by dock row: rollout finished (partial rollout)
``ns:{p}:dockready``               STRING  bitmap by dock row: in the ready mask (partial rollout)
``ns:{p}:dockage``                 HASH    dock row -> age, absent: 0 (partial rollout)
``ns:chan:{c}:meta``               HASH    channel ``c``: maxsize, created_ms, ``w:<key>`` summed weights
``ns:chan:{c}:seq``                STRING  next data-plane id of a tensor item put in the channel
``ns:chan:{c}:q:<key>``            LIST    FIFO of entries ``"<weight>|<payload>"`` of queue ``key``
``ns:chan:{c}:puts``               STREAM  one event per put (wakes blocked ``get``/``get_batch``)
``ns:chan:{c}:gets``               STREAM  one event per get of a bounded channel (wakes blocked ``put``)
``ns:{__chan__.c}:d:<id>:<field>`` STRING  bytes of tensor / TensorDict items of channel ``c`` (redis store)
``ns:{p}:rq:<id>``                 STRING  a call's request record: its script's reply, returned to a
``ns:chan:{c}:rq:<id>``                    retry of the call (``lua/includes/requests.lua``); 2 minutes
=================================  ======  ===============================================

Keys are found through registries, never by a ``SCAN`` pattern (checkpoints, ``Channel.delete``):
the registries above (``partitions``, ``partitions:kept``, ``channels``), each partition's own sets
(``fields``, ``tasks``, ``tagnames``, ``waittasks``, ``trashfields``) and each channel's ``meta`` (a
``w:<key>`` field per non-empty queue) name every key there is, except the sampler caches ``rank:`` /
``bal:``, the calls' request records ``rq:`` and the ``waiters`` of a partition never created, which
expire by themselves. Every name in a key was checked by :mod:`tq_redis.names`; :func:`by_slot` groups
keys for multi-key commands on a Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from redis.crc import key_slot

from tq_redis import names


def check_name(kind: str, value: str) -> str:
    """Validate a name of ``kind`` (see :func:`tq_redis.names.check`); kept for existing callers."""
    return names.check(kind, value)


def partitions_key(ns: str) -> str:
    """ZSET of the namespace's listed partitions (``get_partition_list``)."""
    return f"{names.namespace(ns)}:partitions"


def kept_partitions_key(ns: str) -> str:
    """SET of partition ids whose keys may outlive their entry in :func:`partitions_key`."""
    return f"{names.namespace(ns)}:partitions:kept"


def channels_key(ns: str) -> str:
    """SET of the namespace's channel names."""
    return f"{names.namespace(ns)}:channels"


def config_key(ns: str) -> str:
    """HASH of the namespace's settings, life and identity (``epoch``)."""
    return f"{names.namespace(ns)}:config"


def clients_key(ns: str) -> str:
    """ZSET of the namespace's live client processes: client id -> when it counts as gone (ms)."""
    return f"{names.namespace(ns)}:clients"


def storage_nodes_key(ns: str) -> str:
    """HASH of registered storage nodes: node id -> JSON description (see ``backends/dram``)."""
    return f"{names.namespace(ns)}:storage:nodes"


def storage_epoch_key(ns: str) -> str:
    """STRING: the namespace's epoch, copied from :func:`config_key` for its storage nodes to read."""
    return f"{names.namespace(ns)}:storage:epoch"


def storage_rings_key(ns: str) -> str:
    """HASH of every DRAM node ring a value was put under: ring id -> JSON ``[[node id, address], ...]``."""
    return f"{names.namespace(ns)}:storage:rings"


def storage_repairs_key(ns: str) -> str:
    """HASH of the repairs of replicated DRAM rings: ring id -> JSON ``[[dead node id, ring id], ...]``
    (in order: each copy a dead node held was re-made on a node of the second ring)."""
    return f"{names.namespace(ns)}:storage:repairs"


def storage_repair_key(ns: str) -> str:
    """HASH of the DRAM repair's state and progress (``state``, ``dead``, ``values_total`` ...)."""
    return f"{names.namespace(ns)}:storage:repair"


def storage_repair_lease_key(ns: str) -> str:
    """STRING: the token of the process repairing DRAM replicas now (expires: a lease)."""
    return f"{names.namespace(ns)}:storage:repair:lease"


def pending_deletes_key(ns: str, node_id: str) -> str:
    """LIST of deletes DRAM node ``node_id`` missed while unreachable (it drains them when back)."""
    return f"{names.namespace(ns)}:storage:pending:{node_id}"


def pending_nodes_key(ns: str) -> str:
    """SET of the node ids that have a :func:`pending_deletes_key` list (so nothing needs a SCAN)."""
    return f"{names.namespace(ns)}:storage:pendingnodes"


def by_slot(items: Iterable[Any], key: Callable[[Any], str | bytes] | None = None) -> dict[int, list[Any]]:
    """``items`` (keys, or anything ``key`` maps to a key) grouped by Redis Cluster hash slot, in
    their order: one multi-key command per group works on a cluster."""
    groups: dict[int, list[Any]] = {}
    for item in items:
        name = item if key is None else key(item)
        raw = name if isinstance(name, bytes) else name.encode()
        groups.setdefault(key_slot(raw), []).append(item)
    return groups


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


class _Tagged:
    """Keys ``<ns>:<kind>{<ns>/<tag>}:<suffix>`` sharing one hash tag (one slot on a cluster).

    The namespace is inside the tag so that two jobs' partitions of the same name (every verl job
    has ``train``, ``global_step_1`` ...) land on different slots, hence shards; it also stays in
    front, so ``~<ns>:*`` ACL patterns still hold every key of a namespace.
    """

    __slots__ = ("ns", "prefix")
    _kind = ""

    def _place(self, ns: str, tag: str) -> None:
        self.ns = names.namespace(ns)
        self.prefix = f"{ns}:{self._kind}{{{ns}/{tag}}}:"


class PartitionKeys(_Tagged):
    """Key builder for one partition; all keys share the ``{partition}`` hash tag."""

    __slots__ = ("partition",)

    def __init__(self, ns: str, partition: str) -> None:
        self.partition = names.partition_id(partition)
        self._place(ns, self.partition)

    @classmethod
    def internal(cls, ns: str, partition: str) -> PartitionKeys:
        """Keys of a partition tq-redis names itself (a channel's hidden data partition too)."""
        pk = cls.__new__(cls)
        pk.partition = names.internal_partition_id(partition)
        pk._place(ns, pk.partition)
        return pk

    meta = _Key("meta")
    seq = _Key("seq")
    alive = _Key("alive")
    fields = _Key("fields")
    tasks = _Key("tasks")
    tagnames = _Key("tagnames")
    groups = _Key("groups")
    groupidx = _Key("groupidx", "Sorted mirror of :attr:`groups`: the first id of every insert.")
    kv = _Key("kv")
    kvkeys = _Key("kvkeys", "Reverse map of :attr:`kv`: sample id -> user key.")
    events = _Key("events")
    tagchanges = _Key("tagchanges", "Stream of tag changes (capped): what ``kv_watch`` follows.")
    waittasks = _Key("waittasks")
    waiters = _KeyOf("waiters:")
    waitneed = _KeyOf("waitneed:")
    wake = _KeyOf("wake:")
    wakebudget = _KeyOf("wakebudget:")
    trash = _Key("trash", "Bitmap of samples whose bytes are still to be deleted from the stores.")
    rings = _Key("rings", "Hash of the node rings this partition's store values were put under: ring id -> index.")
    loc = _KeyOf("loc:")
    closed = _Key("closed", "Set once a sealed partition is cleared: puts are refused until it is reopened.")
    inline = _Key("inline", "Hash of small values kept in the metadata plane: ``<id>:<field>`` -> bytes.")
    trash_fields = _Key("trashfields", "Set of the field names the trashed samples may hold bytes for.")
    resv = _Key("resv", "Hash of group reservations: token -> first id, count, start version, committer, fields.")
    resvdl = _Key("resvdl", "Sorted set of the reservations' lease deadlines (server ms).")
    admission = _Key("admission", "Hash of the staleness bound (max_lag, batch), published version, admitted count.")
    admitwaiters = _Key(
        "admitwaiters", "Sorted set of producers the staleness bound or a rate limiter holds back: waiter -> deadline."
    )
    admitwake = _Key("admitwake", "List of wake tokens for the producers held back (staleness bound, rate limiter).")
    ratelimit = _Key(
        "ratelimit", "Hash of the samples-per-insert rate limiters: ``inserts``, ``cfg:<task>``, ``sampled:<task>``."
    )
    dock = _Key("dock", "A GRPOTransferDock's shape (prompts_num, n_samples_per_prompt).")
    dockstate = _Key("dockstate")
    dockmetrics = _Key("dockmetrics")
    dockdone = _Key("dockdone", "Bitmap by dock row: the row's rollout is finished (partial rollout).")
    dockready = _Key("dockready", "Bitmap by dock row: the row is in the ready mask (partial rollout).")
    dockage = _Key("dockage", "Hash of dock row -> age, absent: 0 (partial rollout).")
    prod = _KeyOf("prod:")
    cons = _KeyOf("cons:")
    lease = _KeyOf("lease:")
    deliveries = _KeyOf("dlv:")
    poison = _KeyOf("poison:")
    sampled = _KeyOf("sampled:")
    counters = _Key("counters", "Hash of always-growing event counts: ``expired:<task>``, ``redelivered:<task>``, "
                                "``poison:<task>`` (kept across clears and drops).")
    tag = _KeyOf("tag:")

    def data(self, sample_id: int, field: str) -> str:
        """Data-plane key of one (sample, field) value; every store uses this name."""
        return f"{self.prefix}d:{sample_id}:{field}"

    def data_keys(self, sample_ids: Iterable[int], field: str) -> list[str]:
        """:meth:`data` for many samples of one field (one comprehension: batches are large)."""
        head = f"{self.prefix}d:"
        tail = f":{field}"
        return [f"{head}{i}{tail}" for i in sample_ids]


class ChannelKeys(_Tagged):
    """Key builder for one :class:`tq_redis.Channel`; all keys share the ``{channel}`` hash tag.

    Tensor items go through the data plane under the hidden partition :attr:`data_partition`.
    """

    __slots__ = ("name",)
    _kind = "chan:"

    def __init__(self, ns: str, name: str) -> None:
        self.name = names.channel_name(name)
        self._place(ns, self.name)

    meta = _Key("meta")
    seq = _Key("seq")
    puts = _Key("puts")
    gets = _Key("gets")
    queue = _KeyOf("q:")

    @property
    def data_partition(self) -> str:
        """Partition id whose data-plane keys hold this channel's tensor items (reserved: no user
        partition may take it)."""
        return names.channel_data_partition(self.name)

    def data_keys(self) -> PartitionKeys:
        """Keys of :attr:`data_partition`."""
        return PartitionKeys.internal(self.ns, self.data_partition)
