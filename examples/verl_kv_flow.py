"""verl's real use of ``transfer_queue``, replayed call for call on tq-redis.

verl (``verl/trainer/ppo/v1``, the TransferQueue trainer) drives rollout, reward, log-prob and
advantage stages through the ``transfer_queue`` KV API. This example makes the same calls, with
the same argument shapes, through ``import transfer_queue as tq`` after
``tq_redis.install_transfer_queue_alias()``, and asserts what verl relies on at each step:

 1. the import and verl's checkpoint gate (``tq.__version__ >= 0.1.9`` and callable checkpoint functions);
 2. ``tq.init(config.transfer_queue)`` with verl's config section (``enable``, ``metrics``, ``backend``
    with SimpleStorage and MooncakeStore settings), then the workers' argument-less ``tq.init()``;
 3. the trainer registers prompts by uid, tagged ``{is_prompt, status: pending, global_steps}``;
 4. the agent loop (``AgentLoopWorkerTQ``) moves each prompt's status tag and puts one trajectory per
    put, a ``(1, L)`` tensor per field with L varying between puts (the fields become jagged);
 5. the replay buffer lists the partition (``kv_list``), picks finished groups and clears their prompts;
 6. the colocated reward reads jagged fields (``.offsets()``, ``.to_padded_tensor``) and writes
    jagged ``rm_scores`` back;
 7. batch balancing pads the batch with synthetic samples (``kv_batch_get(...)[0]`` as template)
    and reorders it by the ``seq_len`` tags;
 8. the worker bridge (``tqbridge``) turns the KVBatchMeta into BatchMeta chunks and runs
    ``get_client().async_kv_retrieve_meta / async_get_data / async_put / async_kv_retrieve_keys``;
 9. old log-probs are cut to the response and written back; ``kv_batch_put`` returns the keys' tags;
10. advantages: a read that names fields never written (no critic, no reference model), GRPO per uid;
11. validation on partition ``val`` (rewards scored inside the agent loop);
12. metrics read back lengths and tags;
13. ``tq.save_checkpoint`` with prompts in flight; 14. ``tq.load_checkpoint`` restores it;
15. on resume the in-flight prompts are re-issued; 16. ``kv_clear`` and ``tq.close()``.

Run: ``python examples/verl_kv_flow.py`` (embedded default) or ``python examples/verl_kv_flow.py --ray``
(the agent loop workers run as async Ray actors and the log-prob workers as Ray tasks, and their
argument-less ``tq.init()`` finds the driver's system).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from packaging.version import InvalidVersion, Version
from tensordict import NonTensorData, NonTensorStack, TensorDict

import tq_redis
from tq_redis.redact import redact

tq_redis.install_transfer_queue_alias()

import transfer_queue as tq  # noqa: E402  (verl's import, after the alias is installed)
from transfer_queue import BatchMeta, KVBatchMeta  # noqa: E402

PROMPTS = 3  # train prompts per batch (data.train_batch_size)
N = 2  # rollout.n: sessions per prompt
DP = 2  # data-parallel ranks of the actor
AGENT_WORKERS = 2  # agent loop workers
BATCH_MULTIPLE = 4  # lcm(dp, mini-batch sizes): the batch is padded up to a multiple of it
VAL_PROMPTS = 2
PAD_TOKEN = 0
EOS_TOKEN = 2

# verl/trainer/config/transfer_queue/transfer_queue.yaml (verl's own defaults, a one-node run's
# num_data_storage_units: verl ships 8 and recommends >= 2 per node)
TRANSFER_QUEUE_SECTION: dict[str, Any] = {
    "enable": False,
    "metrics": {"enabled": False, "port": 0},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 2},
        "MooncakeStore": {
            "auto_init": False,
            "metadata_server": "localhost:50123",
            "master_server_address": "localhost:50124",
            "local_hostname": "localhost",
            "protocol": "tcp",
            "global_segment_size": 4294967296,
            "local_buffer_size": 1073741824,
            "device_name": "",
        },
    },
}


# ------------------------------------------------------------------ small helpers verl has too


def rows_to_tensordict(rows: list[dict[str, Any]]) -> TensorDict:
    """Rows of per-sample values -> one TensorDict, as verl's ``list_of_dict_to_tensordict`` builds it.

    A tensor column whose rows share a shape is stacked (one row -> a ``(1, L)`` tensor), other
    tensor columns become jagged nested tensors, anything else a ``NonTensorStack``.
    """
    columns: dict[str, Any] = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if all(isinstance(v, torch.Tensor) for v in values):
            same = all(v.shape == values[0].shape for v in values)
            columns[name] = torch.stack(values) if same else torch.nested.as_nested_tensor(values, layout=torch.jagged)
        else:
            columns[name] = NonTensorStack(*values)
    return TensorDict(columns, batch_size=[len(rows)])


def non_tensor_column(values: list[Any]) -> NonTensorStack:
    """A list -> ``NonTensorStack`` of ``NonTensorData``, as verl's ``get_tensordict`` stores lists."""
    return NonTensorStack.from_list([NonTensorData(v) for v in values])


def plain(value: Any) -> Any:
    """A non-tensor value as verl unwraps it (``getattr(x, "data", x)``)."""
    return getattr(value, "data", value)


def response_from_nested(full: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample model output over prompt+response -> its response part, shifted by one token."""
    values, offsets = full.values(), full.offsets()
    lengths = response_mask.offsets().diff()
    parts = [values[end - n - 1 : end - 1] for n, end in zip(lengths.tolist(), offsets[1:].tolist())]
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def response_to_nested(padded: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A right-padded ``(bsz, max_response)`` tensor -> jagged, cut at each response's length."""
    lengths = response_mask.offsets().diff().tolist()
    return torch.nested.as_nested_tensor([padded[i, :n] for i, n in enumerate(lengths)], layout=torch.jagged)


def lengths_to_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)


def balanced_order(seq_lens: list[int], parts: int) -> list[int]:
    """Indexes in an order whose ``parts`` equal chunks have similar token sums (snake dealing)."""
    ranked = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    buckets: list[list[int]] = [[] for _ in range(parts)]
    for pos, i in enumerate(ranked):
        lap, slot = divmod(pos, parts)
        buckets[slot if lap % 2 == 0 else parts - 1 - slot].append(i)
    return [i for bucket in buckets for i in bucket]


class BridgeLoop:
    """One event loop in a background thread, as verl's ``_run_async_in_temp_loop`` keeps one."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tq-bridge", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


# ------------------------------------------------------------------ the data verl moves


def dataset_batch(start: int, count: int, global_steps: int, validate: bool = False) -> TensorDict:
    """A prompt batch as verl's trainer builds it from the dataloader (``tu.get_tensordict``)."""
    idx = list(range(start, start + count))
    td = TensorDict(
        {
            "dummy_tensor": torch.zeros(count, 1, dtype=torch.uint8),
            "raw_prompt": non_tensor_column([[{"role": "user", "content": f"What is {i} + {i}?"}] for i in idx]),
            "data_source": non_tensor_column(["openai/gsm8k"] * count),
            "reward_model": non_tensor_column([{"style": "rule", "ground_truth": str(2 * i)} for i in idx]),
            "extra_info": non_tensor_column([{"split": "val" if validate else "train", "index": i} for i in idx]),
            "index": non_tensor_column(idx),
            "tools_kwargs": non_tensor_column([{} for _ in idx]),
            "interaction_kwargs": non_tensor_column([{} for _ in idx]),
            "uid": non_tensor_column([str(uuid.uuid4()) for _ in idx]),
        },
        batch_size=[count],
    )
    td["global_steps"] = NonTensorData(global_steps)
    if validate:
        td["validate"] = NonTensorData(True)
    return td


def prompt_rows(batch: TensorDict) -> list[dict[str, Any]]:
    """Row dicts the agent loop worker cuts its batch into (tensors by row, non-tensors unwrapped)."""
    rows = []
    for i in range(batch.batch_size[0]):
        row = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                row[k] = v[i]
            elif isinstance(v, NonTensorStack):
                row[k] = v[i].data
            elif isinstance(v, NonTensorData):
                row[k] = v.data
        rows.append(row)
    return rows


def agent_output(prompt: dict[str, Any], session_id: int, validate: bool) -> dict[str, Any]:
    """A deterministic ``AgentLoopOutput.as_dict()`` for one session (lengths vary by prompt and session)."""
    index = int(prompt["index"])
    gen = torch.Generator().manual_seed(7919 * index + 31 * session_id + (1 if validate else 0))
    prompt_len = 3 + index % 4
    response_len = 2 + (3 * index + 5 * session_id) % 7
    response_mask = torch.ones(response_len, dtype=torch.int64)
    response_mask[response_len // 2] = 0  # a tool-response token
    out: dict[str, Any] = {
        "prompts": torch.randint(10, 1000, (prompt_len,), generator=gen, dtype=torch.int64),
        "responses": torch.randint(10, 1000, (response_len,), generator=gen, dtype=torch.int64),
        "response_mask": response_mask,
        "rollout_log_probs": -torch.rand(response_len, generator=gen, dtype=torch.float32),
        "num_turns": 2,
        "metrics": {"generate_sequences": 0.25 * (session_id + 1), "tool_calls": 0.0},
        "extra_fields": {
            "min_global_steps": int(prompt["global_steps"]),
            "max_global_steps": int(prompt["global_steps"]),
        },
    }
    if validate:  # the reward loop scored it inside the agent loop
        score = float((index + session_id) % 2)
        rm_scores = torch.zeros(response_len, dtype=torch.float32)
        rm_scores[-1] = score
        out["rm_scores"] = rm_scores
        out["extra_fields"]["reward_extra_info"] = {"acc": score}
    return out


def trajectory(prompt: dict[str, Any], session_id: int, validate: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields and tag ``_agent_loop_postprocess`` puts for one session's (single) output."""
    fields = agent_output(prompt, session_id, validate)
    fields.update({k: v for k, v in prompt.items() if k not in ("agent_name", "validate")})
    fields["session_id"] = session_id
    input_ids = torch.cat([fields["prompts"], fields["responses"]])
    fields["loss_mask"] = fields["response_mask"]
    fields["input_ids"] = input_ids
    fields["position_ids"] = torch.arange(input_ids.numel(), dtype=torch.int64)
    fields["multi_modal_inputs"] = {}
    prompt_len, response_len = fields["prompts"].size(0), fields["responses"].size(0)
    tag = {
        "status": "success",
        "prompt_len": prompt_len,
        "response_len": response_len,
        "seq_len": prompt_len + response_len,
        "global_steps": prompt["global_steps"],
        "min_global_steps": fields["extra_fields"].get("min_global_steps"),
        "max_global_steps": fields["extra_fields"].get("max_global_steps"),
    }
    return fields, tag


def fake_log_probs(input_ids: torch.Tensor) -> torch.Tensor:
    """The 'model' of the log-prob workers: a deterministic function of the tokens."""
    return -((input_ids % 13).to(torch.float32) + 1.0) / 8.0


# ------------------------------------------------------------------ the agent loop worker (AgentLoopWorkerTQ)


async def _run_prompt(prompt: dict[str, Any], n: int, validate: bool) -> None:
    uid, partition_id = prompt["uid"], "val" if validate else "train"
    await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "running"})
    sessions = [asyncio.create_task(_run_session(prompt, s, validate)) for s in range(n)]
    errors = [r for r in await asyncio.gather(*sessions, return_exceptions=True) if isinstance(r, BaseException)]
    if errors:
        await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "failure"})
        raise errors[0]
    await tq.async_kv_put(key=uid, partition_id=partition_id, tag={"status": "finished"})


async def _run_session(prompt: dict[str, Any], session_id: int, validate: bool) -> None:
    fields, tag = trajectory(prompt, session_id, validate)
    await tq.async_kv_batch_put(
        keys=[f"{prompt['uid']}_{session_id}_0"],
        fields=rows_to_tensordict([fields]),
        tags=[tag],
        partition_id="val" if validate else "train",
    )


class AgentLoopWorkerTQ:
    """verl's ``AgentLoopWorkerTQ`` (an async Ray actor): ``tq.init()`` with no arguments when it
    starts, then, per batch, every prompt's sessions concurrently on its event loop."""

    def __init__(self) -> None:
        self.cfg = tq.init()

    async def generate_sequences(self, batch: TensorDict, n: int) -> dict[str, Any]:
        validate = bool(plain(batch["validate"])) if "validate" in batch.keys() else False
        await asyncio.gather(*(_run_prompt(row, n, validate) for row in prompt_rows(batch)))
        return {"pid": os.getpid(), "url": self.cfg["redis"]["url"], "namespace": self.cfg["namespace"]}


# ------------------------------------------------------------------ the worker bridge (transferqueue_utils)


async def async_kv_batch_meta2batch_meta(meta: KVBatchMeta) -> BatchMeta:
    tq.init()
    batch_meta = await tq.get_client().async_kv_retrieve_meta(
        keys=meta.keys, partition_id=meta.partition_id, create=False
    )
    if meta.fields is not None:
        batch_meta = batch_meta.select_fields([meta.fields] if isinstance(meta.fields, str) else meta.fields)
    batch_meta.extra_info = meta.extra_info
    return batch_meta


async def async_batch_meta2kv_batch_meta(meta: BatchMeta) -> KVBatchMeta:
    tq.init()
    partition_id = meta.partition_ids[0]
    assert all(pid == partition_id for pid in meta.partition_ids)
    keys = await tq.get_client().async_kv_retrieve_keys(global_indexes=meta.global_indexes, partition_id=partition_id)
    return KVBatchMeta(
        keys=keys, tags=[{}] * meta.size, partition_id=partition_id, fields=meta.field_names, extra_info=meta.extra_info
    )


async def async_meta_to_realdata(meta: BatchMeta) -> TensorDict:
    meta_info = copy.deepcopy(meta.extra_info)
    if meta.size == 0:
        return TensorDict({}, batch_size=(0,))
    td = await tq.get_client().async_get_data(meta)
    for key, val in meta_info.items():
        td[key] = val if isinstance(val, NonTensorData | NonTensorStack) else NonTensorData(val)
    return td


async def async_update_meta_with_output(output: TensorDict, meta: BatchMeta) -> BatchMeta:
    fields = [k for k, v in output.items() if isinstance(v, torch.Tensor | NonTensorStack)]
    extra = {k: v.data for k, v in output.items() if isinstance(v, NonTensorData)}
    if fields:
        meta = await tq.get_client().async_put(data=output.select(*fields), metadata=meta)
        meta.extra_info = extra
    return meta


def compute_log_prob(data: TensorDict) -> TensorDict:
    """The actor's ``compute_log_prob``: log-probs and entropy over prompt+response, jagged."""
    assert plain(data["calculate_entropy"]) is True and plain(data["temperature"]) == 1.0
    rows = data["input_ids"].unbind()
    log_probs = torch.nested.as_nested_tensor([fake_log_probs(r) for r in rows], layout=torch.jagged)
    entropy = torch.nested.as_nested_tensor([-fake_log_probs(r) / 2 for r in rows], layout=torch.jagged)
    return TensorDict({"log_probs": log_probs, "entropy": entropy}, batch_size=[len(rows)])


def log_prob_worker(meta: BatchMeta) -> tuple[BatchMeta, dict[str, Any]]:
    """One dp rank behind ``@tqbridge``: ``tq.init()``, read its shard, compute, write the output back."""
    cfg = tq.init()
    bridge = BridgeLoop()
    try:
        data = bridge.run(async_meta_to_realdata, meta)
        output = compute_log_prob(data)
        assert output.batch_size[0] == meta.size
        out_meta = bridge.run(async_update_meta_with_output, output, meta)
    finally:
        bridge.close()
    return out_meta, {"pid": os.getpid(), "url": cfg["redis"]["url"], "namespace": cfg["namespace"]}


# ------------------------------------------------------------------ the run


@dataclass
class Flow:
    """What the steps hand each other (the trainer's state)."""

    use_ray: bool
    bridge: BridgeLoop
    ckpt_root: Path
    cfg: Any = None
    prompts: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> prompt row
    expected: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> fields put
    expected_tags: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> tag put
    train_batch: TensorDict | None = None
    batch: KVBatchMeta | None = None
    rm_scores: dict[str, torch.Tensor] = field(default_factory=dict)
    pad_keys: list[str] = field(default_factory=list)
    inflight: list[str] = field(default_factory=list)
    partial_key: str = ""
    ckpt_path: Path | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)  # what each worker's tq.init() found
    agent_actors: list[Any] = field(default_factory=list)

    def dispatch(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run a worker function once per argument tuple: here, or with ``--ray`` as concurrent Ray
        tasks, and return the results in order."""
        if not self.use_ray:
            return [fn(*args) for args in calls]
        import ray

        remote = ray.remote(num_cpus=0)(fn)
        return ray.get([remote.remote(*args) for args in calls])

    def rollout(self, batch: TensorDict, n: int) -> None:
        """``AgentLoopManagerTQ.generate_sequences``: chunk the batch over the agent loop workers.

        (verl's call returns at once and its replay buffer polls ``kv_list`` until groups finish;
        here the call waits for the workers, so one ``kv_list`` afterwards sees every group.)
        """
        chunks = batch.chunk(AGENT_WORKERS) if batch.batch_size[0] > 1 else [batch]
        if not self.use_ray:
            self.workers.extend(asyncio.run(AgentLoopWorkerTQ().generate_sequences(c, n)) for c in chunks)
            return
        import ray

        if not self.agent_actors:
            actor_cls = ray.remote(num_cpus=0)(AgentLoopWorkerTQ)
            self.agent_actors = [actor_cls.remote() for _ in range(AGENT_WORKERS)]
        calls = [actor.generate_sequences.remote(c, n) for actor, c in zip(self.agent_actors, chunks)]
        self.workers.extend(ray.get(calls))


def submit_prompts(flow: Flow, batch: TensorDict, partition_id: str, persist: bool) -> list[str]:
    """``_submit_batch_to_rollout``: register prompts by uid (async trainers persist the prompt data)."""
    uids = list(batch["uid"])
    steps = int(plain(batch["global_steps"]))
    tags = [{"is_prompt": True, "status": "pending", "global_steps": steps} for _ in uids]
    if persist:
        keep = [k for k in batch.keys() if not isinstance(batch.get(k), NonTensorData)]
        tq.kv_batch_put(keys=uids, partition_id=partition_id, tags=tags, fields=batch.select(*keep))
    else:
        tq.kv_batch_put(keys=uids, partition_id=partition_id, tags=tags)
    for row in prompt_rows(batch):
        flow.prompts[row["uid"]] = row
    return uids


def expect_trajectories(flow: Flow, uids: list[str], n: int, validate: bool) -> list[str]:
    keys = []
    for uid in uids:
        for s in range(n):
            fields, tag = trajectory(flow.prompts[uid], s, validate)
            key = f"{uid}_{s}_0"
            flow.expected[key], flow.expected_tags[key] = fields, tag
            keys.append(key)
    return keys


def sample(partition_id: str, batch_size: int) -> KVBatchMeta:
    """``ReplayBuffer.sample`` (sync trainer): sync from ``kv_list()``, pick terminal groups, clear their prompts."""
    data = tq.kv_list()
    items = (data or {}).get(partition_id, {})
    trajectories = {k: t for k, t in items.items() if not t.get("is_prompt", False)}
    prompts = {k: t for k, t in items.items() if t.get("is_prompt", False)}
    terminal = [k for k, t in prompts.items() if t["status"] in ("finished", "failure")]
    assert len(terminal) >= batch_size, f"only {len(terminal)} terminal groups of {len(prompts)} prompts"
    chosen = sorted(terminal, key=lambda k: prompts[k]["global_steps"])[:batch_size]
    tq.kv_clear(partition_id=partition_id, keys=chosen)
    keys = [k for k in trajectories if k.split("_")[0] in set(chosen)]
    return KVBatchMeta(partition_id=partition_id, keys=keys, tags=[trajectories[k] for k in keys])


def step_import(flow: Flow) -> str:
    try:
        supported = Version(getattr(tq, "__version__", "")) >= Version("0.1.9")
    except InvalidVersion:
        supported = False
    assert supported, f"transfer_queue.__version__ = {getattr(tq, '__version__', None)!r}: verl needs >= 0.1.9"
    assert callable(getattr(tq, "save_checkpoint", None)) and callable(getattr(tq, "load_checkpoint", None))
    return f"transfer_queue {tq.__version__}, checkpoint supported"


def step_init(flow: Flow) -> str:
    config = OmegaConf.create({"transfer_queue": TRANSFER_QUEUE_SECTION, "trainer": {"v1": {"trainer_mode": "async"}}})
    OmegaConf.set_struct(config, True)  # Hydra hands verl a struct config
    config.transfer_queue.enable = True
    OmegaConf.resolve(config)
    tq.init(config.transfer_queue)
    flow.cfg = tq.init()  # a worker's argument-less init in the same process: the same system
    client = tq.get_client()
    for name in ("async_get_data", "async_put", "async_kv_retrieve_meta", "async_kv_retrieve_keys"):
        assert callable(getattr(client, name, None)), f"get_client() has no {name}"
    return f"metadata plane {redact(flow.cfg['redis']['url'])} namespace {flow.cfg['namespace']!r}"


def step_submit(flow: Flow) -> str:
    flow.train_batch = dataset_batch(0, PROMPTS, global_steps=1)
    uids = submit_prompts(flow, flow.train_batch, "train", persist=True)
    listed = tq.kv_list("train")["train"]
    assert sorted(listed) == sorted(uids), f"kv_list keys {list(listed)} != the prompts put {uids}"
    assert all(listed[u] == {"is_prompt": True, "status": "pending", "global_steps": 1} for u in uids), listed
    return f"{len(uids)} prompts pending"


def step_rollout(flow: Flow) -> str:
    uids = list(flow.prompts)[:PROMPTS]
    flow.rollout(flow.train_batch, N)
    keys = expect_trajectories(flow, uids, N, validate=False)
    lengths = {flow.expected[k]["responses"].numel() for k in keys}
    assert len(lengths) > 1, "the example must put responses of several lengths"
    where = "Ray actors" if flow.use_ray else "this process"
    if flow.use_ray:
        assert all(w["pid"] != os.getpid() for w in flow.workers), "the Ray workers ran in the driver"
        assert all(
            (w["url"], w["namespace"]) == (flow.cfg["redis"]["url"], flow.cfg["namespace"]) for w in flow.workers
        ), f"a worker's tq.init() found another system: {flow.workers}"
    return f"{len(keys)} trajectories, one put each, response lengths {sorted(lengths)}, in {where}"


def step_sample(flow: Flow) -> str:
    listed = tq.kv_list()
    assert listed is not None and "train" in listed
    items = listed["train"]
    for uid in list(flow.prompts)[:PROMPTS]:  # status moved pending -> running -> finished, other tags kept
        assert items[uid] == {"is_prompt": True, "status": "finished", "global_steps": 1}, items[uid]
    for key, tag in flow.expected_tags.items():
        assert items[key] == tag, f"tag of {key}: {items[key]} != {tag}"
    flow.batch = sample("train", PROMPTS)
    assert sorted(flow.batch.keys) == sorted(flow.expected_tags), flow.batch.keys
    after = tq.kv_list("train")["train"]
    assert not [k for k, t in after.items() if t.get("is_prompt")], "the sampled prompts were not cleared"
    assert set(flow.batch.keys) <= set(after)
    return f"kv_list -> {PROMPTS} finished groups, KVBatchMeta of {len(flow.batch)} keys, prompts cleared"


def step_reward(flow: Flow) -> str:
    batch = flow.batch
    data = tq.kv_batch_get(
        keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses", "raw_prompt"]
    )
    prompt_lengths = data["prompts"].offsets().diff()
    response_lengths = data["responses"].offsets().diff()
    prompts = data["prompts"].to_padded_tensor(padding=PAD_TOKEN)
    responses = data["responses"].to_padded_tensor(padding=PAD_TOKEN)
    for i, key in enumerate(batch.keys):
        want_p, want_r = flow.expected[key]["prompts"], flow.expected[key]["responses"]
        assert int(prompt_lengths[i]) == want_p.numel() and int(response_lengths[i]) == want_r.numel(), key
        assert torch.equal(prompts[i, : want_p.numel()], want_p) and bool(
            (prompts[i, want_p.numel() :] == PAD_TOKEN).all()
        )
        assert torch.equal(responses[i, : want_r.numel()], want_r), key
    # a read whose samples happen to share a length (one GRPO group's prompt) is still jagged:
    # verl calls .offsets() whatever the batch
    group = [k for k in batch.keys if k.split("_")[0] == batch.keys[0].split("_")[0]]
    same = tq.kv_batch_get(keys=group, partition_id=batch.partition_id, select_fields="prompts")["prompts"]
    assert same.offsets().diff().tolist() == [flow.expected[group[0]]["prompts"].numel()] * len(group)
    raw_prompts = list(data["raw_prompt"])
    assert [plain(r) for r in raw_prompts] == [flow.expected[k]["raw_prompt"] for k in batch.keys]
    attention_mask = torch.cat(
        [lengths_to_mask(prompt_lengths, prompts.size(1)), lengths_to_mask(response_lengths, responses.size(1))], dim=1
    )
    assert int(attention_mask.sum()) == int(prompt_lengths.sum() + response_lengths.sum())
    # the reward model scores the last response token; written back jagged, with a reward extra key
    padded = torch.zeros(responses.shape, dtype=torch.float32)
    acc = []
    for i, key in enumerate(batch.keys):
        score = float(flow.prompts[key.split("_")[0]]["index"] % 2)
        padded[i, int(response_lengths[i]) - 1] = score
        acc.append(score)
    rm_scores = torch.nested.as_nested_tensor(
        [padded[i, : response_lengths[i]] for i in range(len(batch))], layout=torch.jagged
    )
    write_back = TensorDict({"rm_scores": rm_scores, "acc": non_tensor_column(acc)}, batch_size=[len(batch)])
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=write_back)
    back = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rm_scores", "acc"])
    for i, (row, key) in enumerate(zip(back["rm_scores"].unbind(), batch.keys)):
        flow.rm_scores[key] = padded[i, : response_lengths[i]].clone()
        assert torch.equal(row, flow.rm_scores[key]), f"rm_scores of {key}: {row} != {flow.rm_scores[key]}"
    assert [float(plain(a)) for a in back["acc"]] == acc
    return f"prompts/responses jagged (lengths {response_lengths.tolist()}), rm_scores written back jagged"


def step_balance(flow: Flow) -> str:
    batch = flow.batch
    pad = BATCH_MULTIPLE - len(batch) % BATCH_MULTIPLE
    source_td = tq.kv_batch_get(keys=[batch.keys[0]], partition_id=batch.partition_id)[0]
    template = {
        k: source_td[k].clone() if isinstance(source_td[k], torch.Tensor) else copy.deepcopy(source_td[k])
        for k in source_td.keys()
    }
    tag = dict(copy.deepcopy(batch.tags[0]), is_padding=True, prompt_len=1, response_len=1, seq_len=2)
    one = torch.full((1,), EOS_TOKEN, dtype=torch.int64)
    template.update(
        prompts=one,
        responses=one.clone(),
        input_ids=one.repeat(2),
        attention_mask=torch.ones(2, dtype=torch.int64),
        position_ids=torch.arange(2, dtype=torch.int64),
        num_turns=0,
        response_mask=torch.zeros(1, dtype=torch.int64),
        loss_mask=torch.zeros(1, dtype=torch.int64),
        rm_scores=torch.zeros(1, dtype=torch.float32),
        rollout_log_probs=torch.zeros(1, dtype=torch.float32),
        multi_modal_inputs={},
    )
    pad_uid = f"pad{uuid.uuid4().hex}"
    template["uid"] = pad_uid
    rows = []
    for i in range(pad):
        row = copy.deepcopy(template)
        row["session_id"] = i
        rows.append(row)
    flow.pad_keys = [f"{pad_uid}_{i}_0" for i in range(pad)]
    tq.kv_batch_put(
        keys=flow.pad_keys,
        partition_id=batch.partition_id,
        fields=rows_to_tensordict(rows),
        tags=[copy.deepcopy(tag) for _ in range(pad)],
    )
    for key, row in zip(flow.pad_keys, rows):
        flow.expected[key], flow.expected_tags[key], flow.rm_scores[key] = row, dict(tag), row["rm_scores"]
    batch = KVBatchMeta(
        keys=batch.keys + flow.pad_keys,
        tags=batch.tags + [dict(tag) for _ in range(pad)],
        partition_id=batch.partition_id,
        fields=batch.fields,
        extra_info=batch.extra_info,
    )
    seq_lens = [t["seq_len"] for t in batch.tags]
    order = balanced_order(seq_lens, DP)
    before = list(batch.keys)
    batch.reorder(order)
    assert batch.keys == [before[i] for i in order] and [t["seq_len"] for t in batch.tags] == [
        seq_lens[i] for i in order
    ]
    flow.batch = batch
    halves = [sum(t["seq_len"] for t in part.tags) for part in batch.chunk(DP)]
    return f"padded {pad} synthetic samples from a kv_batch_get(...)[0] template, reordered, tokens per rank {halves}"


def step_bridge(flow: Flow) -> str:
    batch = flow.batch
    batch.extra_info["temperature"] = 1.0
    batch.extra_info.update({"calculate_entropy": True, "compute_loss": False, "temperature": 1.0})
    meta = flow.bridge.run(async_kv_batch_meta2batch_meta, batch)  # BatchData.chunk: KVBatchMeta -> BatchMeta
    assert meta.size == len(batch), (meta.size, len(batch))
    outputs = flow.dispatch(log_prob_worker, [(shard,) for shard in meta.chunk(chunks=DP)])
    shards = [m for m, _ in outputs]
    merged_extra: dict[str, list[Any]] = {}  # BatchData.concat merges extra_info by hand
    for m in shards:
        for k, v in m.extra_info.items():
            merged_extra.setdefault(k, []).append(v)
        m.extra_info = {}
    joined = BatchMeta.concat(shards)
    joined.extra_info = merged_extra
    output = flow.bridge.run(async_batch_meta2kv_batch_meta, joined)
    assert len(output) == len(batch) and output.keys == batch.keys, (output.keys, batch.keys)
    assert {"log_probs", "entropy"} <= set(output.fields or []), output.fields
    pids = {info["pid"] for _, info in outputs}
    if flow.use_ray:
        assert os.getpid() not in pids, "the bridge workers ran in the driver"
        assert all(
            (info["url"], info["namespace"]) == (flow.cfg["redis"]["url"], flow.cfg["namespace"]) for _, info in outputs
        ), "a Ray worker's tq.init() found another system"
    where = f"{len(pids)} Ray worker process(es)" if flow.use_ray else "this process"
    return f"async_kv_retrieve_meta -> {DP} shards -> async_get_data/async_put in {where} -> async_kv_retrieve_keys"


def step_old_log_prob(flow: Flow) -> str:
    batch = flow.batch
    fields = ["entropy", "log_probs", "response_mask", "responses", "rollout_log_probs"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    for row, key in zip(data["log_probs"].unbind(), batch.keys):
        assert torch.equal(row, fake_log_probs(flow.expected[key]["input_ids"])), f"log_probs of {key}"
    data["old_log_probs"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
    data["entropy"] = response_from_nested(data.pop("entropy"), data["response_mask"])
    stored_tags = {k: flow.expected_tags[k] for k in batch.keys}
    batch = tq.kv_batch_put(
        keys=batch.keys, partition_id=batch.partition_id, fields=data.select("old_log_probs", "entropy")
    )
    assert batch.keys == flow.batch.keys
    for key, tag in zip(batch.keys, batch.tags):  # verl reads these tags later (_compute_metrics)
        assert tag == stored_tags[key], f"kv_batch_put returned tag {tag} for {key}, stored {stored_tags[key]}"
    assert {"old_log_probs", "entropy", "prompts"} <= set(batch.fields or []), batch.fields
    flow.batch = batch
    padded = data.to_padded_tensor()
    width = max(flow.expected[k]["responses"].numel() for k in batch.keys)
    assert padded["old_log_probs"].shape == (len(batch), width), padded["old_log_probs"].shape
    mask = padded["response_mask"].bool()
    assert torch.isfinite(padded["entropy"][mask]).all()
    shape = tuple(padded["old_log_probs"].shape)
    return f"log_probs cut to responses and written back, kv_batch_put returned the keys' tags, padded {shape}"


def step_advantage(flow: Flow) -> str:
    batch = flow.batch
    fields = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    assert "ref_log_prob" not in data.keys() and "values" not in data.keys(), sorted(data.keys())
    response_mask = data["response_mask"]
    padded = data.to_padded_tensor()
    uids = np.array(padded.pop("uid").tolist(), dtype=object)
    assert list(uids) == [k.split("_")[0] for k in batch.keys], list(uids)
    scores = padded["rm_scores"].sum(dim=-1)
    for i, key in enumerate(batch.keys):
        assert float(scores[i]) == float(flow.rm_scores[key].sum()), key
    adv = torch.zeros_like(scores)
    for uid in set(uids):
        rows = torch.tensor([i for i, u in enumerate(uids) if u == uid])
        group = scores[rows]
        adv[rows] = (group - group.mean()) / (group.std() + 1e-6) if len(rows) > 1 else 0.0
    advantages = adv.unsqueeze(1) * padded["response_mask"].to(torch.float32)
    output = TensorDict(
        {
            "advantages": response_to_nested(advantages, response_mask),
            "returns": response_to_nested(advantages.clone(), response_mask),
        },
        batch_size=len(batch),
    )
    flow.batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)
    back = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"])
    for got, want in zip(back["advantages"].unbind(), output["advantages"].unbind()):
        assert torch.equal(got, want)
    return f"read without the never-written ref_log_prob/values, GRPO over {len(set(uids))} uid groups, written back"


def step_save(flow: Flow) -> str:
    # the next step's prompts are in flight: one still pending, one running with one session done
    batch = dataset_batch(100, 2, global_steps=2)
    flow.inflight = submit_prompts(flow, batch, "train", persist=True)
    running = flow.inflight[1]
    tq.kv_put(key=running, partition_id="train", tag={"status": "running"})
    fields, tag = trajectory(flow.prompts[running], 0, validate=False)
    flow.partial_key = f"{running}_0_0"
    tq.kv_batch_put(keys=[flow.partial_key], partition_id="train", fields=rows_to_tensordict([fields]), tags=[tag])
    flow.ckpt_path = flow.ckpt_root / "global_step_1" / "transfer_queue"
    tq.save_checkpoint(str(flow.ckpt_path), metadata={"global_steps": 1})
    assert flow.ckpt_path.is_dir()
    return f"saved to {flow.ckpt_path.relative_to(flow.ckpt_root)} with 1 pending + 1 running prompt in flight"


def step_load(flow: Flow) -> str:
    before = tq.kv_list()
    tq.kv_clear(keys=flow.batch.keys, partition_id=flow.batch.partition_id)  # what the step's cleanup does
    tq.kv_put(key="stray", partition_id="train", tag={"status": "noise"})
    assert tq.kv_list("train")["train"].keys().isdisjoint(flow.batch.keys)
    # verl resumes into a fresh, empty system; this process loads over its live one, which a load
    # refuses (NamespaceNotEmpty) unless asked to replace it (the old data's bytes leave the store too)
    tq.load_checkpoint(str(flow.ckpt_path), replace=True)
    after = tq.kv_list()
    assert after == before, f"kv_list after load_checkpoint differs:\n{after}\nvs\n{before}"
    data = tq.kv_batch_get(keys=flow.batch.keys, partition_id="train", select_fields=["responses", "rm_scores"])
    for key, resp, rm in zip(flow.batch.keys, data["responses"].unbind(), data["rm_scores"].unbind()):
        assert torch.equal(resp, flow.expected[key]["responses"]) and torch.equal(rm, flow.rm_scores[key]), key
    return f"restored {sum(len(v) for v in after.values())} keys and their jagged values"


def step_reissue(flow: Flow) -> str:
    global_steps = 2
    items = (tq.kv_list("train") or {}).get("train", {})
    inflight = [k for k, t in items.items() if t.get("is_prompt", False) and t.get("status") in ("pending", "running")]
    assert sorted(inflight) == sorted(flow.inflight), (inflight, flow.inflight)
    batch = tq.kv_batch_get(keys=inflight, partition_id="train")
    assert [plain(r) for r in batch["raw_prompt"]] == [flow.prompts[u]["raw_prompt"] for u in inflight]
    old = [k for k, t in items.items() if not t.get("is_prompt", False) and k.split("_", 1)[0] in set(inflight)]
    assert old == [flow.partial_key], old
    tq.kv_clear(keys=old, partition_id="train")
    tags = [{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in inflight]
    tq.kv_batch_put(keys=inflight, partition_id="train", tags=tags)
    now = tq.kv_list("train")["train"]
    assert all(now[u]["status"] == "pending" and now[u]["global_steps"] == 2 for u in inflight)
    assert flow.partial_key not in now
    return f"{len(inflight)} in-flight prompts re-issued from their persisted data, 1 stale trajectory cleared"


def step_validate(flow: Flow) -> str:
    batch = dataset_batch(200, VAL_PROMPTS, global_steps=1, validate=True)
    uids = list(batch["uid"])
    tags = [{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in uids]
    tq.kv_batch_put(keys=uids, partition_id="val", tags=tags)  # tag-only status markers
    for row in prompt_rows(batch):
        flow.prompts[row["uid"]] = row
    flow.rollout(batch, 1)
    expect_trajectories(flow, uids, 1, validate=True)
    val = sample("val", VAL_PROMPTS)
    text = tq.kv_batch_get(keys=val.keys, partition_id=val.partition_id, select_fields=["prompts", "responses"])
    prompts = text["prompts"].to_padded_tensor(padding=PAD_TOKEN)
    assert prompts.shape[0] == len(val)
    fields = ["uid", "rm_scores", "num_turns", "reward_model", "data_source", "extra_fields"]
    data = tq.kv_batch_get(keys=val.keys, partition_id=val.partition_id, select_fields=fields)
    assert data.pop("uid").tolist() == [k.split("_")[0] for k in val.keys]
    scores = data["rm_scores"].sum(dim=1).tolist()
    want = [float(flow.expected[k]["rm_scores"].sum()) for k in val.keys]
    assert scores == want, (scores, want)
    assert data.pop("num_turns").tolist() == [2] * len(val)
    infos = [e.get("reward_extra_info", {}) for e in data.pop("extra_fields").tolist()]
    assert [i["acc"] for i in infos] == want
    assert [r["ground_truth"] for r in data.pop("reward_model").tolist()] == [
        flow.expected[k]["reward_model"]["ground_truth"] for k in val.keys
    ]
    assert data.pop("data_source").tolist() == ["openai/gsm8k"] * len(val)
    tq.kv_clear(keys=val.keys, partition_id=val.partition_id)
    assert tq.kv_list("val").get("val", {}) == {}
    return f"{len(val)} val trajectories scored in the loop, rm_scores.sum(dim=1) = {scores}"


def step_metrics(flow: Flow) -> str:
    batch = KVBatchMeta(partition_id=flow.batch.partition_id, keys=flow.batch.keys, tags=flow.batch.tags)
    non_padding = np.array([not t.get("is_padding", False) for t in batch.tags], dtype=bool)
    fields = [
        "prompts",
        "responses",
        "response_mask",
        "values",
        "advantages",
        "returns",
        "rm_scores",
        "token_level_rewards",
        "num_turns",
    ]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    num_turns = np.array(data.pop("num_turns").tolist())
    prompt_length = data["prompts"].offsets().diff()
    response_length = data["responses"].offsets().diff()
    assert prompt_length.tolist() == [t["prompt_len"] for t in batch.tags]
    assert response_length.tolist() == [t["response_len"] for t in batch.tags]
    assert num_turns.tolist() == [0 if t.get("is_padding") else 2 for t in batch.tags]
    min_steps = np.array([t["min_global_steps"] for t in batch.tags], dtype=int)[non_padding]
    max_steps = np.array([t["max_global_steps"] for t in batch.tags], dtype=int)[non_padding]
    assert (min_steps == 1).all() and (max_steps == 1).all()
    padded = data.to_padded_tensor()
    if "token_level_rewards" not in padded.keys():
        padded["token_level_rewards"] = padded["rm_scores"]
    assert padded["advantages"].shape == padded["responses"].shape
    return f"{int(non_padding.sum())} real + {int((~non_padding).sum())} padding samples, lengths match their tags"


def step_cleanup(flow: Flow) -> str:
    tq.kv_clear(keys=flow.batch.keys, partition_id=flow.batch.partition_id)
    left = tq.kv_list("train")["train"]
    assert sorted(left) == sorted(flow.inflight), sorted(left)
    tq.kv_clear(keys=flow.inflight, partition_id="train")
    assert tq.kv_list("train").get("train", {}) == {}
    tq.close()
    return "trained keys cleared, in-flight prompts cleared, tq.close()"


STEPS: list[tuple[str, Callable[[Flow], str], tuple[int, ...]]] = [
    ("import transfer_queue and verl's checkpoint gate", step_import, ()),
    ("tq.init(config.transfer_queue) + argument-less tq.init()", step_init, (1,)),
    ("trainer registers prompts (kv_batch_put with tags and prompt fields)", step_submit, (2,)),
    ("agent loop: status tags + one trajectory per async_kv_batch_put", step_rollout, (3,)),
    ("replay buffer: kv_list, pick finished groups, kv_clear prompts", step_sample, (4,)),
    ("colocated reward: offsets()/to_padded_tensor, jagged rm_scores write-back", step_reward, (5,)),
    ("balance batch: padding samples from kv_batch_get(...)[0], reorder", step_balance, (6,)),
    ("worker bridge: get_client().async_* around compute_log_prob", step_bridge, (7,)),
    ("old log-probs written back; kv_batch_put returns the tags", step_old_log_prob, (8,)),
    ("advantages: read naming absent fields, jagged write-back", step_advantage, (9,)),
    ("validation on partition val", step_validate, (2,)),
    ("metrics: lengths and tags of the trained batch", step_metrics, (10,)),
    ("save_checkpoint with prompts in flight", step_save, (2,)),
    ("load_checkpoint restores keys, tags and values", step_load, (10, 13)),
    ("resume: re-issue in-flight prompts", step_reissue, (14,)),
    ("kv_clear and tq.close()", step_cleanup, (15,)),
]


def run(use_ray: bool) -> int:
    failed: list[int] = []
    passed = 0
    with tempfile.TemporaryDirectory(prefix="verl-ckpt-") as ckpt_root:
        flow = Flow(use_ray=use_ray, bridge=BridgeLoop(), ckpt_root=Path(ckpt_root))
        try:
            for number, (title, fn, needs) in enumerate(STEPS, start=1):
                head = f"step {number}/{len(STEPS)}: {title}"
                blocked = [n for n in needs if n in failed]
                if blocked:
                    failed.append(number)
                    print(f"{head} SKIPPED (needs step {blocked[0]})", flush=True)
                    continue
                try:
                    detail = fn(flow)
                except Exception as exc:  # report every step, then exit non-zero
                    failed.append(number)
                    print(f"{head} FAILED: {type(exc).__name__}: {exc}", flush=True)
                    traceback.print_exc(file=sys.stderr)
                    continue
                passed += 1
                print(f"{head}: {detail} ... ok", flush=True)
        finally:
            flow.bridge.close()
            tq.close()
    if failed:
        print(f"verl_kv_flow FAILED: {passed}/{len(STEPS)} steps passed, failed or skipped: {failed}")
        return 1
    print(f"verl_kv_flow OK: {passed}/{len(STEPS)} steps passed" + (" (workers in Ray)" if use_ray else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ray", action="store_true", help="run the agent-loop and log-prob workers in Ray")
    args = parser.parse_args(argv)
    if not args.ray:
        return run(use_ray=False)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    # verl's main_ppo: ray.init with TRANSFER_QUEUE_ENABLE in the workers' environment; the hook
    # installs the alias in every worker, as the stub on PYTHONPATH would
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"TRANSFER_QUEUE_ENABLE": "1", "RAY_USAGE_STATS_ENABLED": "0"},
            "worker_process_setup_hook": "tq_redis.install_transfer_queue_alias",
        },
    )
    try:
        return run(use_ray=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
