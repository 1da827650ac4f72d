"""The key layout: one hash tag per partition (and per channel) with the namespace inside it."""

from __future__ import annotations

from redis.crc import key_slot

from tq_redis.meta.keys import ChannelKeys, PartitionKeys
from tq_redis.ops.checkpoint import placed, portable


def test_every_key_of_a_partition_shares_one_slot_and_starts_with_the_namespace():
    pk = PartitionKeys("jobA", "global_step_1")
    keys = [pk.meta, pk.alive, pk.inline, pk.prod("x"), pk.cons("t"), pk.data(3, "x")]
    assert {key_slot(k.encode()) for k in keys} == {key_slot(pk.meta.encode())}
    assert all(k.startswith("jobA:{jobA/global_step_1}:") for k in keys)


def test_two_jobs_partitions_of_the_same_name_land_on_different_slots():
    names = ["train", "val", "global_step_1", "global_step_2", "p"]
    jobs = ["jobA", "jobB", "jobC"]
    for name in names:
        slots = {key_slot(PartitionKeys(job, name).meta.encode()) for job in jobs}
        assert len(slots) == len(jobs), name  # with the tag {p} alone they were all one slot
    channels = {key_slot(ChannelKeys(job, "rollout").meta.encode()) for job in jobs}
    assert len(channels) == len(jobs)


def test_checkpoints_keep_keys_without_the_namespace_and_place_them_in_any():
    pk, ck = PartitionKeys("a", "p/q"), ChannelKeys("a", "c")
    for key in (pk.meta, pk.prod("x"), ck.meta, ck.queue("default")):
        suffix = key[len("a:") :]
        kept = portable(suffix, "a")
        assert "a/" not in kept.split("}")[0]  # no namespace inside the stored tag
        assert placed(kept, "a") == suffix
        assert placed(kept, "b").startswith(("{b/", "chan:{b/"))
    assert portable("partitions", "a") == placed("partitions", "a") == "partitions"
    assert placed("{p}:meta", "ns") == "{ns/p}:meta"  # a checkpoint of the pre-0.2 layout
