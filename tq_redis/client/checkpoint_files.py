"""What a checkpoint load does before its first write: read and check every file of the directory,
and find what the loading namespace holds (refused unless replaced, then cleared through the stores).

:func:`read_checked` reads each file once, checks it against the manifest (size, SHA-256) and
decodes and checks its contents (:mod:`tq_redis.ops.checkpoint_check`). A checkpoint written before
manifests existed (no ``manifest.json``, and a ``metadata.json`` that names none) is loaded after
the same decoding and checks, without the checksums. The data files are not kept in memory: the
load reads each again when it stores its bytes, and refuses one whose checksum changed since.

:func:`held` names what a namespace holds that a load would delete (its listed partitions, its
channels, a kept partition that still has samples); :func:`clear_held` clears them the way
``clear_partition`` and ``Channel.delete`` do, so their bytes leave every store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tq_redis import names
from tq_redis.errors import CheckpointCorrupt, CheckpointNotFound
from tq_redis.meta.keys import ChannelKeys, PartitionKeys, channels_key, kept_partitions_key, partitions_key
from tq_redis.ops import channel as channel_ops
from tq_redis.ops import checkpoint_check as check
from tq_redis.ops import clear as ops_clear
from tq_redis.ops.checkpoint import DATA_DIR, KEYS_FILE, METADATA_FILE
from tq_redis.ops.encoding import text

__all__ = ["Checked", "Held", "clear_held", "held", "read_bytes", "read_checked"]


@dataclass
class Checked:
    """A checkpoint whose every file was read and checked: its description, its key records, and
    its data files (name, SHA-256) in load order."""

    info: dict[str, Any]
    records: list[list[Any]]
    data: list[tuple[str, str]] = field(default_factory=list)


def read_bytes(root: Path, name: str) -> bytes:
    """The bytes of checkpoint file ``name`` (relative to ``root``)."""
    try:
        return (root / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint file {name} is missing from {root}; save the checkpoint again, "
                                f"or load another one", name) from None
    except OSError as exc:
        raise CheckpointCorrupt(f"checkpoint file {name} in {root} cannot be read ({exc})", name) from None


def read_checked(root: Path) -> Checked:
    """Read and check every file of the checkpoint in ``root`` (see the module docstring).

    Raises:
        CheckpointNotFound: ``root`` or its ``metadata.json`` does not exist.
        CheckpointCorrupt: a file is missing, truncated, altered or malformed (``.file`` names it).
    """
    if not root.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {root} does not exist")
    if not (root / METADATA_FILE).is_file():
        raise CheckpointNotFound(f"{root} is not a checkpoint ({METADATA_FILE} is missing)")
    listed = check.read_manifest(read_bytes(root, check.MANIFEST_FILE)) if (root / check.MANIFEST_FILE).exists() \
        else None
    meta_blob = read_bytes(root, METADATA_FILE)
    if listed is not None:
        check.verify(METADATA_FILE, meta_blob, listed)
    info = check.metadata(meta_blob)
    if listed is None and info.get("manifest"):
        raise CheckpointCorrupt(f"checkpoint file {check.MANIFEST_FILE} is missing from {root} (its "
                                f"{METADATA_FILE} was saved with one); save the checkpoint again", check.MANIFEST_FILE)
    data_names = {f"{DATA_DIR}/{p.name}" for p in (root / DATA_DIR).glob("*.msgpack")}
    if listed is not None:  # a listed file that is gone is missing, one on disk but not listed is foreign
        data_names |= {n for n in listed if n.startswith(DATA_DIR + "/")}
    keys_blob = read_bytes(root, KEYS_FILE)
    if listed is not None:
        check.verify(KEYS_FILE, keys_blob, listed)
    records = check.records(keys_blob, KEYS_FILE)
    data = []
    for name in sorted(data_names):
        blob = read_bytes(root, name)
        sha = check.verify(name, blob, listed) if listed is not None else check.digest(blob)
        check.part(blob, name)
        data.append((name, sha))
    return Checked(info, records, data)


def read_part(root: Path, name: str, sha: str) -> dict[str, Any]:
    """Data file ``name`` read again for the load, refused if it changed since :func:`read_checked`."""
    blob = read_bytes(root, name)
    if check.digest(blob) != sha:
        raise CheckpointCorrupt(f"checkpoint file {name} changed while it was being loaded; load it again", name)
    return check.part(blob, name)


@dataclass
class Held:
    """What a namespace holds that a load would delete."""

    partitions: list[str]
    channels: list[str]

    def __bool__(self) -> bool:
        return bool(self.partitions or self.channels)

    def __str__(self) -> str:
        said = [f"partitions {self.partitions[:5]}"] if self.partitions else []
        said += [f"channels {self.channels[:5]}"] if self.channels else []
        return " and ".join(said)


def held(r: Any, ns: str) -> Held:
    """The partitions (listed, or kept with samples) and channels of namespace ``ns``."""
    pipe = r.pipeline(transaction=False)
    pipe.zrange(partitions_key(ns), 0, -1)
    pipe.smembers(kept_partitions_key(ns))
    pipe.smembers(channels_key(ns))
    listed, kept, chans = pipe.execute()
    partitions = [text(p) for p in listed]
    kept_ids = sorted({text(p) for p in kept} - set(partitions))
    kept_ids = [p for p in kept_ids if not p.startswith(names.RESERVED_PARTITION_PREFIX)]
    if kept_ids:
        pipe = r.pipeline(transaction=False)
        for pid in kept_ids:
            pipe.bitcount(PartitionKeys.internal(ns, pid).alive)
        partitions += [pid for pid, alive in zip(kept_ids, pipe.execute()) if alive]
    return Held(partitions, sorted(text(c) for c in chans))


def clear_held(client: Any, what: Held) -> None:
    """Clear ``what`` through ``client`` (a :class:`~tq_redis.client.checkpoint.CheckpointClient`):
    each partition as ``clear_partition`` does and each channel as ``Channel.delete`` does, so their
    bytes are deleted from every store (an unreachable node's deletes wait for it, as for any clear)."""
    for pid in what.partitions:
        client.run(ops_clear.clear_partition(client.context, pid))
    for name in what.channels:
        client.run(channel_ops.delete(client.context, ChannelKeys(client.namespace, name)))
