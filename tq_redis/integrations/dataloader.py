"""``StreamingDataset`` / ``StreamingDataLoader``: each rank pulls its own micro-batches.

There is no dispatcher: every rank (and every DataLoader worker process of a rank) claims batches
for its ``task_name`` straight from Redis with :func:`tq_redis.ops.streaming.next_batch`, which blocks
on the partition's event stream while nothing is ready and ends the iteration once the producer
called ``seal_partition`` and the task has consumed everything. Works in DataLoader worker
processes (fork, forkserver or spawn): each worker opens its own connection from the config.

Signatures follow TransferQueue 0.1.11's classes. Differences on purpose: ``config`` is the dict
``tq_redis.init()`` returns (or None: the process's ``init`` / ``TQ_REDIS_URL``); iteration ends
when the partition is sealed and drained (the reference streams forever unless
``should_check_consumption_status``); waiting blocks on the event stream instead of sleeping 1 s;
the default ``process_batch_fn`` keeps every micro-batch's metadata aligned with its rows when
the batch does not divide evenly (the reference pairs ``td`` slices with ``meta.chunk``), and a
batch smaller than ``micro_batch_size`` (the last of a sealed partition) is yielded whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader, IterableDataset

from tq_redis.client.blocking import TransferQueueClient
from tq_redis.errors import ConfigError, InvalidArgument
from tq_redis.meta import BatchMeta
from tq_redis.ops import streaming
from tq_redis.ops.batch import read_claimed
from tq_redis.reprs import attrs_repr
from tq_redis.settings import settings as env

Batch = tuple[TensorDict, BatchMeta]


def _plain(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config must be the dict tq_redis.init() returned (or None), got {type(config).__name__}"
        )
    return dict(config)


def connection_settings(config: Any) -> dict[str, Any]:
    """Redis URL, namespace and client options from an ``init()`` config, ``init()`` or the env."""
    conf = _plain(config)
    url = (conf.get("redis") or {}).get("url")
    settings = {
        "redis_url": url,
        "namespace": conf.get("namespace"),
        "allow_pickle": bool((conf.get("codec") or {}).get("allow_pickle", False)),
        "nested_output": bool((conf.get("compat") or {}).get("nested_output", True)),
    }
    if url is None:
        from tq_redis.api.system import NotInitialized, get_client

        try:
            client = get_client()
            settings.update(redis_url=client.redis_url, namespace=settings["namespace"] or client.namespace)
        except NotInitialized:
            settings["redis_url"] = env.redis_url
    if not settings["redis_url"]:
        raise ConfigError(
            "no Redis URL: pass the config tq_redis.init() returned, call tq_redis.init(), "
            "or export TQ_REDIS_URL"
        )
    settings["namespace"] = settings["namespace"] or env.namespace or "tq"
    return settings


def _init_sampler(redis_url: str, namespace: str) -> Any:
    """The default sampler ``init()``'s client in this process has, when it serves the same
    namespace (a class or an instance, which ``<ns>:config`` cannot record); else None: the
    namespace's."""
    from tq_redis.api.system import NotInitialized, get_client

    try:
        client = get_client()
    except NotInitialized:
        return None
    if (client.redis_url, client.namespace) != (redis_url, namespace):
        return None
    return client.context.default_sampler


def default_fetch_batch_fn(
    tq_client: TransferQueueClient,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[TensorDict | None, BatchMeta]:
    """One non-blocking claim, as the reference's default: ``(data, meta)`` or ``(None, empty)``.

    :class:`StreamingDataset` does not use it by default (it runs
    :func:`tq_redis.ops.streaming.next_batch`, which also handles the end of the stream); it is here
    for custom ``fetch_batch_fn`` wrappers.
    """
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    meta = tq_client.get_meta(
        data_fields, batch_size, partition_id, task_name=task_name, sampling_config=config
    )
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: TensorDict, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[Batch]:
    """Split a batch into micro-batches of ``micro_batch_size`` rows (the last may be smaller),
    each paired with the metadata of exactly its rows. Nested (jagged) fields are re-nested."""
    if not isinstance(td, TensorDict):
        raise InvalidArgument(f"chunk_batch_fn expects a TensorDict, got {type(td).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise InvalidArgument(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    total = int(td.batch_size[0])
    nested: dict[str, tuple[tuple[torch.Tensor, ...], torch.layout]] = {}
    dense: dict[str, Any] = {}
    for name, value in td.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            nested[name] = (value.unbind(0), value.layout)
        else:
            dense[name] = value
    dense_td = TensorDict(dense, batch_size=td.batch_size) if dense else None
    out: list[Batch] = []
    for start in range(0, total, micro_batch_size):
        end = min(start + micro_batch_size, total)
        part = dense_td[start:end] if dense_td is not None else TensorDict({}, batch_size=[end - start])
        for name, (rows, layout) in nested.items():
            part[name] = torch.nested.as_nested_tensor(list(rows[start:end]), layout=layout)
        out.append((part, batch_meta[start:end]))
    return out


class StreamingDataset(IterableDataset):
    """Yields ``(TensorDict, BatchMeta)`` micro-batches of one partition for one task and rank.

    Args:
        config: the dict ``tq_redis.init()`` returned (its ``redis.url`` and ``namespace``), or
            None to use this process's ``init()`` / ``TQ_REDIS_URL`` and ``TQ_NAMESPACE``.
        batch_size: samples claimed per fetch.
        micro_batch_size: samples per yielded micro-batch.
        data_fields: fields to read; a sample is claimed once they are all produced.
        partition_id: the partition to read (``step()`` switches to another).
        task_name: the consumer; each sample goes to one rank of the task (fetch mode).
        dp_rank: this rank's data-parallel group, passed to the sampler (with ``batch_index``) so a
            rank-aware sampler gives every rank of one group the same batches.
        should_check_consumption_status: also end once every sample present is consumed, even
            if the partition is not sealed (finite-dataset mode).
        fetch_batch_fn: custom fetch, called like :func:`default_fetch_batch_fn`; when it returns
            no data the dataset waits for the partition's next event and tries again.
        process_batch_fn: custom split of a batch into micro-batches (default :func:`chunk_batch_fn`).
        sampling_config: extra sampler settings (``sampler``, ``max_tokens`` ...).
        drop_last: drop a final batch smaller than ``batch_size`` instead of yielding it.
        timeout: raise ``TimeoutError`` if no batch arrives for this many seconds (None: wait).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: Sequence[str],
        partition_id: str,
        task_name: str,
        dp_rank: int = 0,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., tuple[TensorDict | None, BatchMeta]] | None = None,
        process_batch_fn: Callable[..., list[Batch]] | None = None,
        *,
        sampling_config: dict[str, Any] | None = None,
        drop_last: bool = False,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(data_fields, str) or not data_fields:
            raise InvalidArgument(f"data_fields must be a non-empty list of field names, got {data_fields!r}")
        if dp_rank < 0:
            raise InvalidArgument(f"dp_rank must be >= 0, got {dp_rank}")
        self.settings = connection_settings(config)
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = list(data_fields)
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampling_config = {**(sampling_config or {}), "dp_rank": dp_rank, "task_name": task_name}
        self.drop_last = drop_last
        self.timeout = timeout
        self.buffer: list[Batch] = []
        self.batch_index = 0
        self._client: TransferQueueClient | None = None
        self._pid: int | None = None

    def __repr__(self) -> str:
        return attrs_repr(self, ("partition_id", "task_name", "data_fields", "batch_size", "dp_rank"))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # each process (DataLoader worker) opens its own
        state["_pid"] = None
        return state

    @property
    def client(self) -> TransferQueueClient:
        """This process's client (opened on first use)."""
        if self._client is None or self._pid != os.getpid():
            s = self.settings
            self._client = TransferQueueClient(
                s["redis_url"], s["namespace"],
                allow_pickle=s["allow_pickle"], nested_output=s["nested_output"],
                sampler=_init_sampler(s["redis_url"], s["namespace"]),
            )
            self._pid = os.getpid()
        return self._client

    def __iter__(self) -> Iterator[Batch]:
        while True:
            if self.batch_index < len(self.buffer):
                data, meta = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(data, meta, micro_batch_size=self.micro_batch_size)
                continue
            batch = self._fetch()
            if batch is None:
                return
            self.buffer.append(batch)

    def _sampling_config(self) -> dict[str, Any]:
        return {**self.sampling_config, "batch_index": self.batch_index, "partition_id": self.partition_id}

    def _fetch(self) -> Batch | None:
        client = self.client
        if self.fetch_batch_fn is None:
            values: dict[str, list] = {}  # the batch's inline values, which come with its claim
            meta = client.run(
                streaming.next_batch(
                    client.context, self.data_fields, self.batch_size, self.partition_id, self.task_name,
                    self._sampling_config(), drop_last=self.drop_last,
                    end_when_consumed=self.should_check_consumption_status, timeout=self.timeout,
                    values=values,
                )
            )
            return None if meta is None else (client.run(read_claimed(client.context, meta, values)), meta)
        return self._fetch_custom(client)

    def _fetch_custom(self, client: TransferQueueClient) -> Batch | None:
        while True:
            state = client.run(
                streaming.progress(client.context, self.partition_id, self.task_name, self.data_fields)
            )
            data, meta = self.fetch_batch_fn(  # type: ignore[misc]
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config=self.sampling_config,
                batch_index=self.batch_index,
            )
            if data is not None:
                return data, meta
            if state.drained or (self.should_check_consumption_status and state.alive and state.pending == 0):
                return None
            wait = streaming.wait_for_event(
                client.context, self.partition_id, state.last_event_id, streaming.WAIT_SLICE_S
            )
            client.run(wait)

    def reset(self) -> None:
        """Start the next iteration from the first buffered batch (replay, then fetch more)."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to another partition (e.g. the next training step) and drop the buffer."""
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id

    def close(self) -> None:
        """Close this process's client."""
        if self._client is not None:
            self._client.close()
            self._client = None


def _identity_collate(batch: Batch) -> Batch:
    return batch


class StreamingDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` over a :class:`StreamingDataset`.

    Batching is the dataset's (``batch_size=None`` here); each item is ``(TensorDict, BatchMeta)``.
    With ``num_workers > 0`` every worker process claims its own batches independently.
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        self.dataset: StreamingDataset = dataset
        super().__init__(
            dataset=dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity_collate,
            pin_memory=pin_memory,
            drop_last=False,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def __repr__(self) -> str:
        return attrs_repr(self, ("dataset", "num_workers"))

    def reset(self) -> None:
        """See :meth:`StreamingDataset.reset`."""
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        """See :meth:`StreamingDataset.step`."""
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[Batch]:
        """The batches this process fetched so far (see :meth:`StreamingDataset.reset`)."""
        return self.dataset.buffer
