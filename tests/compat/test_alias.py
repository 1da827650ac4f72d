"""The ``transfer_queue`` alias (``tq_redis.integrations.alias``): modules, refusal, stub, controller inspector."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import types

import pytest
import torch
from tensordict import TensorDict

import tq_redis
from tests.conftest import make_client
from tq_redis.api import config
from tq_redis.errors import ConfigError
from tq_redis.integrations import alias as compat
from tq_redis.integrations import controller


@pytest.fixture
def clean_modules(monkeypatch):
    """Run with no transfer_queue modules imported; restore whatever was there afterwards."""
    for name in [n for n in list(sys.modules) if n == "transfer_queue" or n.startswith("transfer_queue.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in list(sys.modules) if n == "transfer_queue" or n.startswith("transfer_queue.")]:
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_alias_maps_public_names_onto_tq_redis(clean_modules):
    alias = tq_redis.install_transfer_queue_alias()
    assert tq_redis.install_transfer_queue_alias() is alias  # idempotent
    import transfer_queue as tq
    from transfer_queue.dataloader.streaming_dataset import chunk_batch_fn
    from transfer_queue.metadata import BatchMeta, KVBatchMeta
    from transfer_queue.sampler import BaseSampler
    from transfer_queue.sampler.seqlen_balanced_sampler import get_seqlen_balanced_partitions
    from transfer_queue.storage import StorageKeyNotFoundError

    assert tq is alias and tq.__version__ == compat.REFERENCE_API_LEVEL == tq_redis.REFERENCE_API_LEVEL
    assert BatchMeta is tq_redis.BatchMeta and KVBatchMeta is tq_redis.KVBatchMeta
    assert BaseSampler is tq_redis.BaseSampler and tq.SeqlenBalancedSampler is tq_redis.SeqlenBalancedSampler
    assert tq.kv_batch_put is tq_redis.kv_batch_put and tq.get_client is tq_redis.get_client
    assert tq.init is controller.init and tq.close is controller.close  # these add the controller inspector
    assert tq.StorageKeyNotFoundError is StorageKeyNotFoundError is tq_redis.StorageKeyNotFoundError
    assert chunk_batch_fn.__module__ == "tq_redis.integrations.dataloader" and callable(get_seqlen_balanced_partitions)
    assert "kv_put" in dir(tq.interface)
    with pytest.raises(AttributeError, match="only the reference's public API"):
        _ = tq.TransferQueueController
    with pytest.raises(ModuleNotFoundError):
        import transfer_queue.utils.zmq_utils  # noqa: F401  - an internal of the reference


def test_alias_refuses_a_real_transfer_queue(clean_modules):
    real = types.ModuleType("transfer_queue")
    real.__file__ = "/site-packages/transfer_queue/__init__.py"
    sys.modules["transfer_queue"] = real
    with pytest.raises(ConfigError, match="real transfer_queue package is already imported.*pip uninstall"):
        compat.install_transfer_queue_alias()
    assert sys.modules["transfer_queue"] is real  # left untouched


def test_stub_on_pythonpath_installs_the_alias_in_a_child_process(clean_modules, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    compat.install_transfer_queue_alias(propagate=True)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == compat.alias_pythonpath()
    code = (
        "import transfer_queue as tq, tq_redis\n"
        "from transfer_queue.metadata import BatchMeta\n"
        "assert BatchMeta is tq_redis.BatchMeta and tq.__version__ == tq_redis.REFERENCE_API_LEVEL\n"
        "assert getattr(tq, '__tq_redis_alias__', False)\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ["PYTHONPATH"], root]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    cli = subprocess.run([sys.executable, "-m", "tq_redis.integrations.alias", "--pythonpath"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.stdout.strip() == compat.alias_pythonpath()


def test_inspector_reads_partitions_keys_tags_and_production(server, namespace):
    writer = make_client(server.url, namespace)
    given = {"redis": {"url": server.url}, "namespace": namespace, "controller": {"relax_owner_token": "t1"}}
    inspector = controller.ControllerInspector(controller._shareable_conf(given))
    try:
        writer.kv_batch_put(keys=["a", "b"], partition_id="p", tags=[{"step": 0, "tags": ["x"]}, {}],
                            fields=TensorDict({"ids": torch.arange(4).reshape(2, 2)}, batch_size=[2]))
        writer.kv_put(key="b", partition_id="p", fields={"extra": torch.ones(3)})
        assert inspector.list_partitions() == ["p"]
        conf = inspector.get_config()  # a DictConfig, as the reference's: Relax reads conf.controller
        assert conf["namespace"] == namespace and conf.controller.relax_owner_token == "t1"
        assert conf.redis.url == server.url
        snap = inspector.get_partition_snapshot("p")
        ga, gb = snap.keys_mapping["a"], snap.keys_mapping["b"]
        assert sorted(snap.global_indexes) == sorted([ga, gb])
        assert snap.custom_meta[ga] == {"step": 0, "tags": ["x"]} and snap.custom_meta[gb] == {}
        assert set(snap.field_name_mapping) == {"ids", "extra"}
        col = snap.field_name_mapping["extra"]
        assert snap.production_status[gb, col] == 1 and snap.production_status[ga, col] == 0
        assert snap.production_status[ga, snap.field_name_mapping["ids"]] == 1
        assert snap.revert_keys_mapping[ga] == "a"
        assert inspector.get_partition_index_range("p") == sorted([ga, gb])
        assert inspector.get_partition_index_range("nothing") == []
        writer.kv_clear(keys=["a"], partition_id="p")
        assert "a" not in inspector.get_partition_snapshot("p").keys_mapping
        inspector.clear_partition("p")
        inspector.clear_partition("p")  # idempotent
        assert inspector.list_partitions() == [] and inspector.get_partition_snapshot("p") is None
    finally:
        writer.close()


def test_alias_serves_the_modules_the_reference_recipes_import(clean_modules, monkeypatch):
    import importlib.resources

    from omegaconf import OmegaConf

    tq_redis.install_transfer_queue_alias()
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.utils.logging_utils import get_logger

    monkeypatch.setenv("TQ_LOGGING_LEVEL", "INFO")
    log = get_logger("tq-alias-test", default_level="ERROR")
    assert log.level == logging.INFO and log.hasHandlers()
    monkeypatch.setenv("TQ_LOGGING_LEVEL", "LOUD")
    with pytest.raises(ConfigError, match="TQ_LOGGING_LEVEL='LOUD' is not a logging level"):
        get_logger("tq-alias-test")
    conf = OmegaConf.load(importlib.resources.files("transfer_queue") / "config.yaml")
    conf = OmegaConf.merge(conf, {"backend": {"SimpleStorage": {"num_data_storage_units": 3}}})
    effective = config.load(conf)  # what init() makes of it
    assert effective["storage"]["units"] == 3 and effective["storage"]["backend"] == "dram"
    assert effective["sampler"] == "SequentialSampler"
    assert hasattr(TransferQueueController, "options") and TransferQueueController is controller.TransferQueueController
    with pytest.raises(ModuleNotFoundError):
        import transfer_queue.storage.simple_backend  # noqa: F401  - an internal of the reference


def test_simple_storage_unit_takes_the_ray_options_nemo_rl_passes(clean_modules):
    """NeMo-RL imports SimpleStorageUnit to wrap its .options with a runtime_env; the stand-in takes
    any Ray option, starts nothing, and says how tq-redis starts storage if used as a unit."""
    tq_redis.install_transfer_queue_alias()
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    original = SimpleStorageUnit.options

    def patched(*args, **kwargs):  # NeMo-RL's wrapper, in shape
        kwargs.setdefault("runtime_env", {"pip": ["transferqueue==0.1.11"]})
        return original(*args, **kwargs)

    SimpleStorageUnit.options = patched
    try:
        unit = SimpleStorageUnit.options(
            num_cpus=4, resources={"node:10.0.0.1": 0.001}, name="TransferQueueStorageUnit#0",
            scheduling_strategy=object(), runtime_env={"env_vars": {"OMP_NUM_THREADS": "2"}},
        ).remote(storage_unit_size=128)
    finally:
        SimpleStorageUnit.options = original
    assert unit.options["num_cpus"] == 4 and unit.options["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "2"}}
    assert unit.kwargs == {"storage_unit_size": 128}
    assert SimpleStorageUnit.remote(config={}).kwargs == {"config": {}}
    with pytest.raises(ConfigError, match="tq-redis starts its storage nodes itself"):
        unit.get_zmq_server_info.remote()
    with pytest.raises(ConfigError, match="not instantiated directly"):
        SimpleStorageUnit()


def test_async_client_checkpoint_calls_of_the_reference(server, namespace, tmp_path):
    """AsyncTransferQueueClient's four checkpoint coroutines run the same checkpoint code as the
    blocking client's calls, off the event loop (the loop keeps running while one saves)."""
    writer = make_client(server.url, namespace)
    aclient = tq_redis.AsyncTransferQueueClient(server.url, namespace, nested_output=False)

    async def scenario() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await aclient.async_save_storage_checkpoint(str(tmp_path / "storage"))
        await aclient.async_save_controller_checkpoint(str(tmp_path / "controller"))
        ticker.cancel()
        writer.clear_partition("p")
        assert await aclient.async_get_partition_list() == []
        await aclient.async_load_storage_checkpoint(str(tmp_path / "storage"))
        data = await aclient.async_get_data(meta)
        assert torch.equal(data["x"], torch.arange(6).reshape(3, 2))
        writer.clear_partition("p")
        await aclient.async_load_controller_checkpoint(str(tmp_path / "controller"))
        assert await aclient.async_get_partition_list() == ["p"]
        await aclient.async_close()
        return ticks

    try:
        meta = writer.put(TensorDict({"x": torch.arange(6).reshape(3, 2)}, batch_size=[3]), partition_id="p")
        assert asyncio.run(scenario()) > 0
        assert (tmp_path / "storage").is_dir() and (tmp_path / "controller").is_dir()
    finally:
        aclient.close()
        writer.close()


def test_client_checkpoint_calls_of_the_reference(server, namespace, tmp_path):
    client = make_client(server.url, namespace)
    try:
        meta = client.put(TensorDict({"x": torch.arange(6).reshape(3, 2)}, batch_size=[3]), partition_id="p")
        client.save_storage_checkpoint(str(tmp_path / "storage"))
        client.save_controller_checkpoint(str(tmp_path / "controller.pkl"))
        client.clear_partition("p")
        assert client.get_partition_list() == []
        client.load_storage_checkpoint(str(tmp_path / "storage"))
        assert torch.equal(client.get_data(meta)["x"], torch.arange(6).reshape(3, 2))
        # "p" is back: loading over it is asked for (a namespace holding data is refused by default)
        asyncio.run(client.async_load_controller_checkpoint(str(tmp_path / "controller.pkl"), replace=True))
        assert client.get_partition_list() == ["p"]
    finally:
        client.close()
