"""MMGRPOTransferDock with MindSpeed-RL's call shapes (``mindspeed_rl/trainer/utils/mm_transfer_dock.py``).

Written from MindSpeed-RL's API and its workers' calls: the trainer's
``put_experience(batch, indexes=range(prompts * n))`` of the dataset batch, ``get_columns(stage)``,
``get_experience(stage, mm_columns, index, get_n_samples)`` with the GRPO dock's sample indexes,
the ViT worker's ``put_experience(batch={"vit_embeds": ...}, indexes=prompts)``, dynamic sampling's
``get_experience_dict(mm_columns, kept, False)`` put into a second dock, and ``clear()`` — within
one process and across processes sharing the dock.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import tq_redis
from tests.conftest import make_client
from tests.procs import mp_context
from tq_redis import MMGRPOTransferDock
from tq_redis.dock.multimodal import MM_EXPERIENCE_COLUMNS
from tq_redis.errors import BatchSizeMismatch, InvalidArgument

PIXEL_DIM = 6


@pytest.fixture
def target(server, namespace):
    make_client(server.url, namespace).close()  # records the namespace's store
    return {"redis_url": server.url, "namespace": namespace}


def prompt_batch(prompts: range) -> dict:
    """A multimodal dataset batch as MindSpeed's dataloader gives it: per prompt, its flattened image
    (``[1, c*h*w]``), shapes, counts, patches (``[patches, dim]``, a prompt's own count) and label."""
    batch: dict = {k: [] for k in ("prompts", "image", "image_shape", "image_num", "pixel_values",
                                   "image_grid_thw", "labels", "video_num")}
    for p in prompts:
        h = 2 + p % 3
        batch["prompts"].append(torch.tensor([p, p]))  # a GRPO dock column: ignored by this dock
        batch["image"].append(torch.full((1, 3 * h * 2), p, dtype=torch.uint8))
        batch["image_shape"].append(torch.tensor([[3, h, 2]]))
        batch["image_num"].append(torch.tensor([1]))
        batch["pixel_values"].append(torch.full((h, PIXEL_DIM), float(p)).to(torch.bfloat16))
        batch["image_grid_thw"].append(torch.tensor([[1, h, 1]]))
        batch["labels"].append(f"answer-{p}")
        batch["video_num"].append(0)
    return batch


def test_construction_columns_and_export(target):
    dock = MMGRPOTransferDock(4, 2, **target)
    assert tq_redis.MMGRPOTransferDock is MMGRPOTransferDock and "MMGRPOTransferDock" in tq_redis.__all__
    assert (dock.prompts_num, dock.n_samples_per_prompt, dock.max_len) == (4, 2, 4)  # one row per prompt
    assert dock.experience_columns == list(MM_EXPERIENCE_COLUMNS)
    assert dock.consumer_columns["actor_train"] == ["pixel_values", "image_grid_thw", "image_num", "video_num"]
    assert dock.consumer_columns["rule_reward"] == ["labels"] and "actor_image_embeds" not in dock.consumer_columns
    assert (dock.timeout, dock.timeout_interval) == (300, 5)
    reuse = MMGRPOTransferDock(4, 2, True, 10, 2, **target)  # MindSpeed's positional order
    assert reuse.consumer_columns["actor_rollout"] == ["vit_embeds", "image_grid_thw", "image_num", "video_num"]
    assert reuse.consumer_columns["actor_image_embeds"][0] == "pixel_values" and reuse.timeout == 10
    assert dock.get_experience_len() == 4
    with pytest.raises(InvalidArgument, match="n_samples_per_prompt"):
        MMGRPOTransferDock(4, 0, **target)
    for d in (dock, reuse):
        d.close()


def test_trainer_put_then_workers_read_as_mindspeed(target):
    n, prompts = 2, 4
    dock = MMGRPOTransferDock(prompts, n, **target)
    assert dock.get_columns("actor_train") == [] and dock.get_columns(None) == []  # nothing put yet
    assert dock.get_experience("actor_train", ["pixel_values"]) == {}  # no indexes: {}
    batch = prompt_batch(range(prompts))
    # the trainer: the dataset batch, indexes over the samples (longer than the prompts)
    dock.put_experience(batch, indexes=list(range(prompts * n)))
    assert dock.get_columns("actor_train") == ["pixel_values", "image_grid_thw", "image_num", "video_num"]
    assert dock.get_columns("rule_reward") == ["labels"]
    assert dock.get_columns("actor_rollout") == []  # no video columns put: MindSpeed says []
    assert dock.get_columns("no_such_stage") == []

    # a worker holding the GRPO dock's sample rows 4..7 (prompts 2 and 3), whole prompts
    columns = dock.get_columns("actor_train")
    got = dock.get_experience("actor_train", columns, [4, 5, 6, 7], True)
    assert set(got) == set(columns)
    assert got["pixel_values"].dtype == torch.bfloat16
    assert got["pixel_values"].shape == (4 + 2, PIXEL_DIM)  # prompt 2 has 4 patches, prompt 3 has 2
    assert got["pixel_values"][:4].float().unique().tolist() == [2.0]
    assert got["image_grid_thw"].tolist() == [[1, 4, 1], [1, 2, 1]]
    assert got["image_num"].tolist() == [[1], [1]] and got["video_num"].tolist() == [[0], [0]]
    # single samples (get_n_samples=False): each sample's prompt, repeats allowed
    single = dock.get_experience("actor_log_prob", ["image_num", "labels"], [1, 0, 5], False)
    assert single["labels"] == ["answer-0", "answer-0", "answer-2"] and single["image_num"].shape == (3, 1)
    media = dock.get_experience("actor_rollout", ["image", "image_shape"], [2, 3])
    assert media["image"].shape == (1, 3 * 3 * 2) and media["image_shape"].tolist() == [[3, 3, 2]]
    # -2 (a partial-rollout claim's padding) repeats the row before it
    padded = dock.get_experience("actor_rollout", ["labels"], [6, -2, -2], False)
    assert padded["labels"] == ["answer-3"] * 3

    # the ViT worker: embeddings of prompts 0 and 1, by prompt index
    embeds = [torch.randn(3, 4), torch.randn(5, 4)]
    dock.put_experience(batch={"vit_embeds": embeds}, indexes=[0, 1])
    back = dock.get_experience_dict(["vit_embeds", "labels"], [0, 1, 2, 3], True)
    assert [tuple(t.shape) for t in back["vit_embeds"]] == [(3, 4), (5, 4)]
    assert all(torch.equal(a, b) for a, b in zip(back["vit_embeds"], embeds))
    assert back["labels"] == ["answer-0", "answer-1"]

    status = dock.get_experience_status()
    assert status["pixel_values"].tolist() == [1, 1, 1, 1] and status["vit_embeds"].tolist() == [1, 1, 0, 0]
    dock.clear()
    assert dock.get_columns("actor_train") == [] and dock.get_experience_status()["labels"].sum() == 0
    dock.put_experience(batch=prompt_batch(range(1)), indexes=[3])  # the next step
    assert dock.get_experience_dict(["labels"], [6], True) == {"labels": ["answer-0"]}
    dock.close()


def test_dynamic_sampling_moves_rows_into_a_second_dock(target):
    n = 2
    sampling = MMGRPOTransferDock(4, n, **target)
    main = MMGRPOTransferDock(2, n, **target)
    sampling.put_experience(prompt_batch(range(4)), list(range(8)))
    kept = [2, 3, 6, 7]  # prompts 1 and 3 kept
    columns = sampling.get_columns("dynamic_sampling")
    moved = sampling.get_experience_dict(columns, kept, False)
    assert len(moved["pixel_values"]) == 4  # one entry per sample, as MindSpeed's dict has
    index_list = [0, 1, 2, 3]  # the main dock's rows, from prefetch_request_index
    main.put_experience(sampling.get_experience_dict(columns, kept, True), [i // n for i in index_list[::n]])
    got = main.get_experience("actor_train", columns, index_list, True)
    assert got["image_grid_thw"].tolist() == [[1, 3, 1], [1, 2, 1]]  # prompts 1 and 3
    for d in (sampling, main):
        d.close()


def test_puts_of_a_tensordict_and_bad_input(target):
    dock = MMGRPOTransferDock(4, 1, **target)
    td = TensorDict({"position_ids": torch.arange(8).reshape(2, 4), "prompts": torch.zeros(2, 3)}, batch_size=[2])
    dock.put_experience(td, indexes=[0, 1])
    assert dock.get_experience("x", ["position_ids"], [1, 0])["position_ids"].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    dock.put_experience({"prompts": [torch.ones(1)]})  # no column of this dock: nothing to do, as in MindSpeed
    dock.put_experience({"labels": ["a", None]}, [2, 3])  # None rows are not put
    assert dock.get_experience_status()["labels"].tolist() == [0, 0, 1, 0]
    with pytest.raises(InvalidArgument, match="indexes="):
        dock.put_experience({"labels": ["a"]})
    with pytest.raises(BatchSizeMismatch, match="2 rows but only 1"):
        dock.put_experience({"labels": ["a", "b"]}, [0])
    with pytest.raises(InvalidArgument, match="outside"):
        dock.put_experience({"labels": ["a"]}, [4])
    with pytest.raises(InvalidArgument, match="unique"):
        dock.put_experience({"labels": ["a", "b"]}, [1, 1])
    with pytest.raises(InvalidArgument, match="rank or dtype"):
        dock.put_experience({"labels": ["a"], "pixel_values": [torch.ones(2, 3), torch.ones(2)]}, [0, 1])
    with pytest.raises(InvalidArgument, match="mixes"):
        dock.put_experience({"image_num": [torch.tensor([1]), 2]}, [0, 1])
    with pytest.raises(InvalidArgument, match="not dock columns"):
        dock.get_experience("x", ["prompts"], [0])
    with pytest.raises(InvalidArgument, match="not a row"):
        dock.get_experience("x", ["labels"], [-1])
    with pytest.raises(TimeoutError):
        dock.get_experience("x", ["labels"], [0], timeout=0.2)  # row 0 has no label
    assert dock.get_experience_status()["labels"].tolist() == [0, 0, 1, 0]  # nothing half-written
    dock.close()


# ------------------------------------------------------------------ across processes


def _vit_worker(dock: MMGRPOTransferDock, prompts: list[int], out) -> None:
    """A ViT worker: reads its prompts' pixels (waiting for them), puts their embeddings."""
    columns = []
    while not columns:
        columns = dock.get_columns("actor_image_embeds")
    n = dock.n_samples_per_prompt  # the GRPO dock's sample indexes of these prompts; every n-th kept
    got = dock.get_experience_dict(columns, [s for p in prompts for s in range(p * n, (p + 1) * n)], True)
    embeds = [pv.float().mean(dim=1, keepdim=True).repeat(1, 2) for pv in got["pixel_values"]]
    dock.put_experience(batch={"vit_embeds": embeds}, indexes=prompts)
    out.put(prompts)
    dock.close()


def _reader(dock: MMGRPOTransferDock, samples: list[int], out) -> None:
    """A training worker: waits for the embeddings of its samples' prompts and checks them."""
    got = dock.get_experience("actor_train", ["vit_embeds", "image_grid_thw"], samples, False, timeout=60)
    rows = got["vit_embeds"][:, 0].tolist()
    out.put((samples, rows, got["image_grid_thw"][:, 1].tolist()))
    dock.close()


def test_processes_share_the_dock_with_mindspeed_calls(real_server, namespace):
    make_client(real_server.url, namespace).close()
    n, prompts = 2, 8
    dock = MMGRPOTransferDock(prompts, n, reuse_image_embeds=True, redis_url=real_server.url, namespace=namespace)
    ctx = mp_context()
    out = ctx.Queue()
    # readers start first and wait; ViT workers wait for the trainer's put; the dock pickles to its name
    readers = [ctx.Process(target=_reader, args=(dock, list(range(r, prompts * n, 4)), out)) for r in range(4)]
    vits = [ctx.Process(target=_vit_worker, args=(dock, list(range(w, prompts, 2)), out)) for w in range(2)]
    for p in readers + vits:
        p.start()
    dock.put_experience(prompt_batch(range(prompts)), indexes=list(range(prompts * n)))
    results = [out.get(timeout=120) for _ in readers + vits]
    for p in readers + vits:
        p.join(60)
        assert p.exitcode == 0
    done = sorted(p for r in results if isinstance(r, list) for p in r)
    assert done == list(range(prompts))  # every prompt embedded once
    reads = [r for r in results if isinstance(r, tuple)]
    assert sorted(s for samples, _, _ in reads for s in samples) == list(range(prompts * n))
    for samples, rows, heights in reads:
        # merged along dim 0: each sample's prompt contributes its own patches, in the samples' order
        assert rows == [float(s // n) for s in samples for _ in range(2 + (s // n) % 3)]
        assert heights == [2 + (s // n) % 3 for s in samples]
    dock.clear()
    assert dock.get_columns("actor_train") == []
    dock.close()
