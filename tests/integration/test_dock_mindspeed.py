"""GRPOTransferDock with MindSpeed-RL's call shapes: its constructor, defaults, result layout and methods.

Written from MindSpeed-RL's documented API (``mindspeed_rl/trainer/utils/transfer_dock.py``): the
scenarios of its ``TestGRPOTransferDock`` (construct with its arguments, put/get round trip,
consumer status and clear), each other public method, the metrics methods, and the dock as a Ray
actor built with ``ray.remote(GRPOTransferDock)`` exactly as MindSpeed builds its own.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from examples.transfer_dock import pad, unpad  # MindSpeed-RL's padded layout, as its callers build it
from tests.conftest import make_client
from tests.procs import gather, mp_context
from tq_redis import GRPOTransferDock
from tq_redis.dock.dock import DockMetrics, TransferDock
from tq_redis.errors import BatchSizeMismatch, ConfigError, InvalidArgument


class StepMetric:
    """A metrics object with MindSpeed-RL's ``Metric`` contract (``metric``, ``update``, ``reset``)."""

    def __init__(self) -> None:
        self.metric: dict = {}
        self.resets = 0

    def update(self, key="", value=None, cumulate=False):
        pairs = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in pairs:
            if cumulate:
                self.metric.setdefault(name, []).extend(item)
            else:
                self.metric[name] = item

    def reset(self):
        self.metric = {}
        self.resets += 1


@pytest.fixture
def target(server, namespace):
    make_client(server.url, namespace).close()  # records the namespace's store
    return {"redis_url": server.url, "namespace": namespace}


# ------------------------------------------------------------------ TestGRPOTransferDock's scenarios


def test_construction_takes_mindspeed_positional_arguments(target):
    dock = GRPOTransferDock(16, 1, StepMetric(), 1, 16, ["metric_for_dapo"], ["dynamic_sampling"], 10, 2, **target)
    assert (dock.prompts_num, dock.n_samples_per_prompt, dock.max_len) == (16, 1, 16)
    assert (dock.max_age, dock.GBS_train, dock.timeout, dock.timeout_interval) == (1, 16, 10, 2)
    assert "metric_for_dapo" in dock.experience_columns and "prompts" in dock.experience_columns
    status = dock.get_consumer_status()
    assert {"grpo_metrics", "actor_train", "dynamic_sampling"} <= set(status)
    assert all(s.dtype == torch.int32 and s.tolist() == [0] * 16 for s in status.values())
    assert dock.get_experience_len() == 16

    defaults = GRPOTransferDock(prompts_num=4, n_samples_per_prompt=2, **target)
    assert (defaults.metrics, defaults.max_age, defaults.GBS_train) == (None, 1, 0)
    assert (defaults.timeout, defaults.timeout_interval) == (300, 5)
    assert defaults.name != dock.name  # each construction is a new dock, as each MindSpeed actor is
    with pytest.raises(InvalidArgument, match="partial rollout.*GBS_train"):
        GRPOTransferDock(4, 2, None, 2, 0, **target)  # max_age > 1 needs GBS_train (test_dock_partial.py)
    odd = GRPOTransferDock(4, 2, ["prompts"], **target)  # the 3rd positional argument is metrics: any object
    assert odd.metrics == ["prompts"] and odd.get_metrics() == ["prompts"]  # MindSpeed returns it as given
    with pytest.raises(InvalidArgument, match="update.*type list"):
        odd.update_metrics("a", 1.0)  # only an update needs update() (MindSpeed: AttributeError here)
    odd.close()
    with pytest.raises(InvalidArgument, match="another name"):
        GRPOTransferDock(8, 2, name=defaults.name, **target)  # same name, other shape
    for d in (dock, defaults):
        d.close()


def test_put_then_get_by_indexes_round_trips_tensordicts(target):
    dock = GRPOTransferDock(prompts_num=16, n_samples_per_prompt=1, metrics=StepMetric(), **target)
    prompts = [torch.randn(1, 8) for _ in range(4)]
    put_indexes = random.sample(range(16), 4)
    assert dock.put_experience(data_dict=TensorDict.from_dict({"prompts": torch.stack(prompts)}),
                               indexes=put_indexes) == put_indexes
    get_indexes = random.sample(put_indexes, 2)
    batch, out = dock.get_experience(consumer="actor_rollout", experience_columns=["prompts"], indexes=get_indexes)
    assert out == get_indexes and len(batch["prompts"]) == 2
    for index in put_indexes:
        batch, out = dock.get_experience(consumer="actor_rollout", experience_columns=["prompts"], indexes=[index])
        assert out == [index]
        assert torch.equal(batch["prompts"][0], prompts[put_indexes.index(index)])
    batch, out = dock.get_experience("trainer", ["prompts"], indexes=[put_indexes[0]] * 2)  # repeats allowed
    assert out == [put_indexes[0]] * 2 and torch.equal(batch["prompts"][1], prompts[0])
    dock.close()


def test_padded_layout_carries_original_length_both_ways(target):
    dock = GRPOTransferDock(2, 2, **target)
    responses = [torch.arange(n, dtype=torch.int64) + 2**40 for n in (3, 1, 4, 2)]  # int64 kept
    lengths = torch.tensor([[3], [1], [4], [2]])
    dock.put_experience(pad({"responses": responses, "response_length": list(lengths)}), indexes=[0, 1, 2, 3])
    batch, rows = dock.get_experience("actor_train", ["responses", "response_length"], 4)  # get_n_samples=True
    assert rows == [0, 1, 2, 3]
    assert batch["responses"].shape == (4, 4) and batch["responses"][1].tolist() == [2**40, 0, 0, 0]
    assert batch["original_length"].tolist() == [3, 1, 4, 2, 1, 1, 1, 1]
    back = unpad(batch, ["responses", "response_length"])
    assert all(torch.equal(a, b) for a, b in zip(back["responses"], responses))
    assert torch.equal(torch.cat(back["response_length"]), lengths.flatten())
    # what a stage gets it can put back as is: the padding is cut off again
    dock.put_experience(batch, indexes=rows)
    again, _ = dock.get_experience("trainer", ["responses"], indexes=rows, layout="jagged")
    assert [r.tolist() for r in again["responses"].unbind()] == [r.tolist() for r in responses]
    with pytest.raises(BatchSizeMismatch, match="original_length"):
        dock.put_experience(TensorDict.from_dict({"responses": torch.ones(2, 3), "original_length": torch.ones(3)}),
                            indexes=[0, 1])
    dock.close()


def test_consumer_status_all_consumed_and_clear(target):
    dock = GRPOTransferDock(4, 2, StepMetric(), **target)
    dock.put_experience({"prompts": [torch.ones(3)] * 8, "prompt_length": torch.full((8, 1), 3)},
                        indexes=list(range(8)), is_prompt=True)
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 4)
    assert rows == [0, 1, 2, 3]
    assert dock.get_consumer_status()["actor_rollout"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert not dock.all_consumed("actor_rollout", True)
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 4)
    assert rows == [4, 5, 6, 7] and dock.all_consumed("actor_rollout") and not dock.all_consumed("trainer")
    assert dock.get_experience("actor_rollout", ["prompts"], 4) == (None, None)
    assert dock.get_experience_status()["prompts"].tolist() == [1] * 8
    dock.update_metrics("timing/rollout", [1.5], cumulate=True)
    assert dock.prefetch_request_index(3) == [0, 1, 2]

    dock.clear(consumer="actor_train")
    assert all(s.sum() == 0 for s in dock.get_consumer_status().values())
    assert dock.get_experience_status()["prompts"].sum() == 0 and not dock.all_consumed("actor_rollout")
    assert dock.get_metrics().metric == {} and dock.get_cur_index() == 0
    with pytest.raises(InvalidArgument, match="consumer"):
        dock.clear(consumer="nobody")
    bare = GRPOTransferDock(1, 1, **target)  # clear works without metrics (MindSpeed raises there)
    bare.clear()
    for d in (dock, bare):
        d.close()


def test_without_an_address_the_error_says_how_to_give_one(monkeypatch):
    import tq_redis.api.system

    def not_initialized():
        raise tq_redis.api.system.NotInitialized("not initialized")

    monkeypatch.setattr(tq_redis.api.system, "get_client", not_initialized)
    monkeypatch.delenv("TQ_REDIS_URL", raising=False)
    with pytest.raises(ConfigError, match="GRPOTransferDock needs the Redis URL.*runtime_env"):
        GRPOTransferDock(16, 1, StepMetric())


# ------------------------------------------------------------------ the other methods


def test_get_n_samples_is_the_default_and_gbs_train_caps_it(target):
    dock = GRPOTransferDock(4, 2, None, 1, 2, **target)  # GBS_train=2 prompts
    dock.put_experience({"prompts": [torch.ones(2)] * 8}, indexes=list(range(8)))
    with pytest.raises(InvalidArgument, match="multiple of n_samples_per_prompt"):
        dock.get_experience("actor_train", ["prompts"], 1)
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [2, 3]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)  # 2 prompts consumed: capped
    assert dock.get_experience("actor_train", ["prompts"], 1, get_n_samples=False)[1] == [4]  # single rows: no cap
    uncapped = GRPOTransferDock(4, 2, **target)  # GBS_train=0: no cap (MindSpeed would hand out nothing)
    uncapped.put_experience({"prompts": [torch.ones(2)] * 8}, indexes=list(range(8)))
    assert [uncapped.get_experience("ref_log_prob", ["prompts"], 4)[1] for _ in range(2)] == [[0, 1, 2, 3],
                                                                                            [4, 5, 6, 7]]
    for d in (dock, uncapped):
        d.close()


def test_update_ready_and_incomplete_responses(target):
    dock = GRPOTransferDock(2, 2, None, 1, 1, **target)
    dock.put_experience({"prompts": [torch.ones(2)] * 4}, indexes=[0, 1, 2, 3])
    assert int(dock.get_incomplete_response_num()) == 4
    assert not dock.get_update_ready(require_max_age_all_finished=False)
    dock.put_experience({"responses": [torch.ones(1)] * 3}, indexes=[0, 1, 2])
    num = dock.get_incomplete_response_num()
    assert isinstance(num, torch.Tensor) and num.dtype == torch.int64 and int(num) == 1
    assert dock.get_update_ready(False) and not dock.get_update_ready(True)  # one prompt done; row 3 is not
    dock.put_experience({"responses": [torch.ones(1)]}, indexes=[3])
    assert dock.get_update_ready() and int(dock.get_incomplete_response_num()) == 0
    dock.close()


def test_bad_rows_raise_typed_errors(target):
    dock = GRPOTransferDock(2, 2, **target)
    with pytest.raises(InvalidArgument, match="outside"):
        dock.put_experience({"prompts": torch.ones(1, 2)}, indexes=[-2])  # MindSpeed skips negative rows
    with pytest.raises(InvalidArgument, match="unique"):
        dock.put_experience({"prompts": torch.ones(2, 2)}, indexes=[1, 1])  # MindSpeed keeps the last
    with pytest.raises(InvalidArgument, match="not dock columns"):
        dock.get_experience("trainer", ["age"], indexes=[0])
    with pytest.raises(InvalidArgument, match="must divide"):
        dock.get_experience("trainer", ["prompts"], 8)
    with pytest.raises(InvalidArgument, match="experience_count"):
        dock.get_experience("trainer", ["prompts"])
    assert dock.get_experience_status()["prompts"].sum() == 0  # nothing half-written
    dock.close()


def _prefetch(dock: GRPOTransferDock, size: int, out) -> None:
    got = []
    while (rows := dock.prefetch_request_index(size)) is not None:
        got.append(rows)
    out.put(got)
    dock.close()


def test_prefetch_request_index_across_processes(real_server, namespace):
    make_client(real_server.url, namespace).close()
    dock = GRPOTransferDock(50, 2, redis_url=real_server.url, namespace=namespace)
    assert dock.get_cur_index() == 0 and dock.prefetch_request_index(0) == []
    ctx = mp_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_prefetch, args=(dock, 3, out)) for _ in range(3)]  # the dock pickles to its name
    got = [rows for each in gather(procs, out, timeout=60) for rows in each]
    assert sorted(i for rows in got for i in rows) == list(range(100))  # every row once, none twice
    assert sorted(len(rows) for rows in got)[0] == 1  # the last request is cut at the end of the dock
    assert dock.get_cur_index() == 102 and dock.prefetch_request_index(1) is None  # as MindSpeed counts
    dock.clear()
    assert dock.get_cur_index() == 0 and dock.prefetch_request_index(2) == [0, 1]
    dock.close()


class Uncopyable:
    """A metrics object MindSpeed would take (it is never copied there)."""

    def __deepcopy__(self, memo):
        raise TypeError("holds a lock")

    def update(self, key="", value=None, cumulate=False):
        raise AssertionError("the dock calls update only for update_metrics")


def test_any_metrics_object_is_accepted_and_update_is_only_called_to_update(target):
    dock = GRPOTransferDock(2, 1, Uncopyable(), **target)
    dock.put_experience(TensorDict({"prompts": torch.arange(4).reshape(2, 2)}, batch_size=[2]), indexes=[0, 1])
    data, idx = dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)
    assert sorted(idx) == [0, 1] and dock.all_consumed("actor_rollout")
    dock.clear()
    with pytest.raises(InvalidArgument, match="cannot be copied.*holds a lock"):
        dock.update_metrics("a", 1.0)  # typed, and nothing recorded
    assert dock._cmd("LLEN", dock._metrics_key) == 0
    dock.close()


def test_metrics_are_shared_and_keep_the_given_class(target):
    dock = GRPOTransferDock(2, 1, StepMetric(), **target)
    other = GRPOTransferDock(2, 1, StepMetric(), name=dock.name, **target)  # another process's view
    dock.update_metrics("timing/adv", value=[2.0, 1.0], cumulate=True)
    other.update_metrics("timing/adv", value=[4.0, 3.0], cumulate=True)
    other.update_metrics(value={"response_length/mean": 7.5, "grad_norm": torch.tensor(0.25)})
    dock.update_metrics("vllm_tps", 123.0)
    got = dock.get_metrics()
    assert isinstance(got, StepMetric) and got.resets == 1  # a fresh copy of the given object
    assert got.metric["timing/adv"] == [2.0, 1.0, 4.0, 3.0]
    assert got.metric["response_length/mean"] == 7.5 and got.metric["vllm_tps"] == 123.0
    assert torch.equal(got.metric["grad_norm"], torch.tensor(0.25))
    with pytest.raises(InvalidArgument, match="cumulate"):
        dock.update_metrics("timing/adv", value=5.0, cumulate=True)  # not a list: rejected, not recorded
    assert other.get_metrics().metric["timing/adv"] == [2.0, 1.0, 4.0, 3.0]
    plain = GRPOTransferDock(2, 1, **target)
    plain.update_metrics("a", [1], cumulate=True)
    plain.update_metrics("a", [2], cumulate=True)
    assert isinstance(plain.get_metrics(), DockMetrics) and plain.get_metrics().metric == {"a": [1, 2]}
    other.clear()
    assert dock.get_metrics().metric == {}
    for d in (dock, other, plain):
        d.close()


def test_base_class_api(target):
    base = TransferDock(4, 1, ["default"], 10, 2, **target)
    assert (base.timeout, base.timeout_interval, base.max_len) == (10, 2, 4)
    rows = [torch.randn(1, 8) for _ in range(2)]
    base._put(["default"], [rows], [3, 1])
    got = base._get(["default"], [1, 3])
    assert torch.equal(got[0][0], rows[1]) and torch.equal(got[0][1], rows[0])
    assert base.experience_data_status["default"].tolist() == [0, 1, 0, 1]
    data = base.get_experience_data()["default"]
    assert data[0] is None and torch.equal(data[3], rows[0])
    base.close()


# ------------------------------------------------------------------ as a Ray actor


def test_ray_remote_dock_with_mindspeed_arguments(ray_local, valkey, namespace):
    ray = ray_local
    make_client(valkey.url, namespace).close()
    env = {"env_vars": {"TQ_REDIS_URL": valkey.url, "TQ_NAMESPACE": namespace}}  # how the actor finds Redis
    td = ray.remote(GRPOTransferDock).options(runtime_env=env).remote(
        prompts_num=16, n_samples_per_prompt=1, metrics=StepMetric()
    )
    assert "grpo_metrics" in ray.get(td.get_consumer_status.remote())
    prompts = [torch.randn(1, 8) for _ in range(4)]
    put_indexes = random.sample(range(16), 4)
    ray.get(td.put_experience.remote(data_dict=TensorDict.from_dict({"prompts": torch.stack(prompts)}),
                                     indexes=put_indexes))
    batch, out = ray.get(td.get_experience.remote(consumer="actor_rollout", experience_columns=["prompts"],
                                                  indexes=put_indexes[:2]))
    assert out == put_indexes[:2] and torch.equal(batch["prompts"][1], prompts[1])
    # a claim, as MindSpeed's stages make them: the remaining two rows, then nothing
    batch, out = ray.get(td.get_experience.remote("actor_rollout", ["prompts"], 2))
    assert sorted(out) == sorted(put_indexes[2:]) and batch["original_length"].tolist() == [1, 1]
    assert ray.get(td.get_experience.remote("actor_rollout", ["prompts"], 2)) == (None, None)
    ray.get(td.update_metrics.remote("timing/rollout", value=[1.0, 2.0], cumulate=True))
    metrics = ray.get(td.get_metrics.remote())
    assert isinstance(metrics, StepMetric) and metrics.metric == {"timing/rollout": [1.0, 2.0]}
    assert ray.get(td.prefetch_request_index.remote(4)) == [0, 1, 2, 3] and ray.get(td.get_cur_index.remote()) == 4
    ray.get(td.clear.remote())
    assert ray.get(td.get_consumer_status.remote())["actor_rollout"].sum() == 0
    assert ray.get(td.get_metrics.remote()).metric == {}
    ray.kill(td)
