"""load_checkpoint is all or nothing, on Valkey and Redis 7.0: every file is read, checked against the
manifest save_checkpoint writes and decoded before the first write, so a damaged checkpoint raises
CheckpointCorrupt naming the file and leaves every key (and every stored byte) as it was; a namespace
holding data is refused unless replace=True, which frees the old data's bytes on the storage nodes.

Before: a truncated or garbage key file raised StorageError after the live values were overwritten
(2.0 became 1.0); a metadata.json that is not JSON raised a raw JSONDecodeError; a load into a
namespace holding other data deleted its keys and left its bytes on the storage nodes.
"""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tests.integration.conftest import key_snapshot
from tq_redis.backends.dram.launcher import start_local_nodes
from tq_redis.client import checkpoint
from tq_redis.codec import objects
from tq_redis.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    NamespaceNotEmpty,
    SampleNotFound,
    StorageError,
    UnknownPartition,
)

KEYS = "redis_keys.msgpack"
META = "metadata.json"


def _x(client) -> list[float]:
    return client.get_data(client.get_meta(["x"], 2, "p", mode="force_fetch"))["x"].tolist()


def _saved_then_changed(client, path):
    """A checkpoint of x = 1.0, then the live value rewritten to 2.0."""
    meta = client.put(TensorDict({"x": torch.ones(2)}, [2]), partition_id="p")
    checkpoint.save(client, path)
    client.put(TensorDict({"x": torch.full((2,), 2.0)}, [2]), metadata=meta)
    assert _x(client) == [2.0, 2.0]


def _legacy(path) -> None:
    """Make ``path`` a checkpoint as the previous version wrote it: no manifest."""
    (path / "manifest.json").unlink()
    info = json.loads((path / META).read_text())
    del info["manifest"]
    (path / META).write_text(json.dumps(info))


def _truncate(path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])


def _garbage(path) -> None:
    path.write_bytes(bytes((b * 7 + 3) % 256 for b in path.read_bytes()))


DAMAGES = {
    "truncated key file": (KEYS, _truncate, "has .* bytes, manifest.json says"),
    "garbage key file": (KEYS, _garbage, "does not match its sha256"),
    "metadata.json not JSON": (META, lambda p: p.write_text("{not json"), "has .* bytes|does not match"),
    "manifest.json not JSON": ("manifest.json", lambda p: p.write_text("[1, 2"), "is not JSON"),
    "key file missing": (KEYS, lambda p: p.unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_before_anything_is_written(rclient, tmp_path, damage):
    name, spoil, said = DAMAGES[damage]
    _saved_then_changed(rclient, tmp_path / "ckpt")
    spoil(tmp_path / "ckpt" / name)
    before = key_snapshot(rclient)
    with pytest.raises(CheckpointCorrupt, match=f"checkpoint file {name} ({said})") as err:
        checkpoint.load(rclient, tmp_path / "ckpt", replace=True)
    assert err.value.file == name and isinstance(err.value, StorageError | ValueError)
    assert key_snapshot(rclient) == before
    assert _x(rclient) == [2.0, 2.0]  # was overwritten with the checkpoint's 1.0


LEGACY_DAMAGES = {
    "truncated key file": (KEYS, _truncate, "cannot be decoded"),
    "garbage key file": (KEYS, _garbage, "cannot be decoded|holds a|record 0"),
    "key file of another shape": (KEYS, lambda p: p.write_bytes(objects.encode_object({"a": 1})), "holds a dict"),
    "a record of another shape": (KEYS, lambda p: p.write_bytes(objects.encode_object([["{p}:meta", "hash"]])),
                                  "record 0 is not"),
    "a key checkpoints never hold": (KEYS, lambda p: p.write_bytes(objects.encode_object(
        [["config", "hash", {b"storage": b"{}"}, -1]])), "record 0 holds key 'config'"),
    "metadata.json not JSON": (META, lambda p: p.write_text("{not json"), "is not JSON"),
    "metadata.json of another format": (META, lambda p: p.write_text('{"format": 9, "backend": "redis"}'),
                                        "says format 9"),
}


@pytest.mark.parametrize("damage", LEGACY_DAMAGES)
def test_a_checkpoint_without_a_manifest_is_decoded_and_checked_before_any_write(rclient, tmp_path, damage):
    """Checkpoints the previous version saved have no manifest: they still load, after every file
    is decoded and its shape checked."""
    name, spoil, said = LEGACY_DAMAGES[damage]
    _saved_then_changed(rclient, tmp_path / "ckpt")
    _legacy(tmp_path / "ckpt")
    spoil(tmp_path / "ckpt" / name)
    before = key_snapshot(rclient)
    with pytest.raises(CheckpointCorrupt, match=f"checkpoint file {name} ({said})") as err:
        checkpoint.load(rclient, tmp_path / "ckpt", replace=True)
    assert err.value.file == name
    assert key_snapshot(rclient) == before
    assert _x(rclient) == [2.0, 2.0]


def test_an_intact_checkpoint_without_a_manifest_still_loads(rclient, tmp_path):
    _saved_then_changed(rclient, tmp_path / "ckpt")
    _legacy(tmp_path / "ckpt")
    checkpoint.load(rclient, tmp_path / "ckpt", replace=True)
    assert _x(rclient) == [1.0, 1.0]


def test_a_manifest_lists_every_file_with_its_size_and_checksum(rclient, tmp_path):
    _saved_then_changed(rclient, tmp_path / "ckpt")
    listed = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
    assert sorted(listed) == sorted([KEYS, META])
    for name, line in listed.items():
        assert line["size"] == (tmp_path / "ckpt" / name).stat().st_size and len(line["sha256"]) == 64
    with pytest.raises(CheckpointNotFound, match=META):  # a FileNotFoundError, as the reference raises
        checkpoint.load(rclient, tmp_path)
    with pytest.raises(FileNotFoundError):
        checkpoint.load(rclient, tmp_path / "nowhere")


def test_loading_into_a_namespace_that_holds_data_is_refused(rclient, tmp_path):
    _saved_then_changed(rclient, tmp_path / "ckpt")
    rclient.put(TensorDict({"y": torch.arange(3)}, [3]), partition_id="other")
    before = key_snapshot(rclient)
    with pytest.raises(NamespaceNotEmpty, match=r"holds partitions \['p', 'other'\].*replace=True"):
        checkpoint.load(rclient, tmp_path / "ckpt")
    assert key_snapshot(rclient) == before
    rclient.clear_partition("p")
    rclient.clear_partition("other")
    checkpoint.load(rclient, tmp_path / "ckpt")  # a cleared namespace is empty: no replace needed
    assert _x(rclient) == [1.0, 1.0] and rclient.get_partition_list() == ["p"]


def _used(client) -> tuple[int, int]:
    """(bytes, keys) the namespace's DRAM storage nodes hold, asked of the nodes themselves."""
    stats = client.context.storage.store.stats().values()
    return sum(s["used"] for s in stats), sum(s["keys"] for s in stats)


def test_replacing_frees_the_old_bytes_on_the_dram_nodes(real_server, namespace, tmp_path):
    nodes = start_local_nodes(real_server.url, namespace, n=2, capacity="64MiB")
    client = make_client(real_server.url, namespace, backend="dram")
    try:
        client.put(TensorDict({"x": torch.ones(2)}, [2]), partition_id="p")
        client.put(TensorDict({"z": torch.ones(3, 4)}, [3]), partition_id="q")
        saved = _used(client)
        checkpoint.save(client, tmp_path / "ckpt")
        client.clear_partition("q")
        other = client.put(TensorDict({"big": torch.ones(8, 4096)}, [8]), partition_id="other")
        live = _used(client)
        assert live != saved

        # a damaged data file: refused before any byte reached a node
        (tmp_path / "bad").mkdir()
        checkpoint.save(client, tmp_path / "bad" / "ckpt")
        _truncate(next((tmp_path / "bad" / "ckpt" / "data").glob("*.msgpack")))
        before = key_snapshot(client)
        with pytest.raises(CheckpointCorrupt, match=r"checkpoint file data/\d+\.msgpack has"):
            checkpoint.load(client, tmp_path / "bad" / "ckpt", replace=True)
        assert key_snapshot(client) == before and _used(client) == live

        with pytest.raises(NamespaceNotEmpty):
            checkpoint.load(client, tmp_path / "ckpt")
        assert key_snapshot(client) == before and _used(client) == live

        checkpoint.load(client, tmp_path / "ckpt", replace=True)
        assert _used(client) == saved  # the replaced data's bytes left the nodes: nothing leaked
        assert sorted(client.get_partition_list()) == ["p", "q"]
        assert _x(client) == [1.0, 1.0]
        q = client.get_data(client.get_meta(["z"], 3, "q", mode="force_fetch"))
        assert q["z"].tolist() == [[1.0] * 4] * 3
        with pytest.raises((SampleNotFound, UnknownPartition)):  # the replaced samples are gone
            client.get_data(other)
    finally:
        client.close()
        nodes.stop()
