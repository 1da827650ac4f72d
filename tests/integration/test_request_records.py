"""The request record wrapper (``lua/includes/requests.lua``) on every server flavour.

A probe library built from the real includes wraps a script that counts its runs and returns a
reply with every kind of value Redis converts (integers, a float, strings with any byte, nested
arrays, false, true, a status reply, an array cut at its first nil). The second call with the same
record key returns exactly the first call's reply and does not run the script; a script that
raises is not recorded (a retry runs it again); a call without a record key runs every time; a
last key outside the partition's prefix is refused; a claim is recorded only when it handed samples
out. On fakeredis, which has no cmsgpack, the
record takes the wrapper's own format.
"""

from __future__ import annotations

import uuid

import pytest
import redis
import torch
from tensordict import TensorDict

from tq_redis.meta.keys import PartitionKeys
from tq_redis.server import library

PROBE = """
local function probe(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local runs = redis.call('INCR', prefix .. 'probe')
  if ARGV[1] == 'fail' then return redis.error_reply('ERR probe failed on run ' .. runs) end
  if ARGV[1] == 'raise' then error('probe raised on run ' .. runs) end
  return {runs, 'bytes\\0\\255\\n:s3:', {2, false, 3, {'deep', 1.75}}, 2.9, -7.5, true, {ok = 'fine'},
          {1, nil, 3}, ''}
end
"""


def _source() -> tuple[str, str]:
    root = library._lua_dir().joinpath("includes")
    parts = [root.joinpath(f"{name}.lua").read_text() for name in ("prefix", library.RECORD_INCLUDE)]
    name = f"tqprobe{uuid.uuid4().hex[:8]}"
    register = f"redis.register_function('{name}', function(KEYS, ARGV) return recorded(probe, KEYS, ARGV) end)"
    return name, f"#!lua name={name}\n" + "\n".join(parts) + PROBE + register


@pytest.fixture
def probe(server, namespace):
    name, source = _source()
    r = redis.Redis.from_url(server.url)
    r.execute_command("FUNCTION", "LOAD", "REPLACE", source)
    yield r, name, PartitionKeys(namespace, "p")
    r.execute_command("FUNCTION", "DELETE", name)
    r.close()


def test_a_retry_gets_the_recorded_reply_exactly(probe):
    r, name, pk = probe
    record = library.record_key(pk.meta, "r1")
    first = r.execute_command("FCALL", name, 2, pk.meta, record, "ok")
    again = r.execute_command("FCALL", name, 2, pk.meta, record, "ok")
    assert first == again
    assert first[0] == 1 and int(r.get(pk.prefix + "probe")) == 1  # ran once
    assert first[1] == b"bytes\x00\xff\n:s3:" and first[2] == [2, None, 3, [b"deep", 1]]
    assert first[3:] == [2, -7, 1, b"fine", [1], b""]
    assert 0 < r.pttl(record) <= 120_000
    other = r.execute_command("FCALL", name, 2, pk.meta, library.record_key(pk.meta, "r2"), "ok")
    assert other[0] == 2  # another request id: another run
    assert r.execute_command("FCALL", name, 1, pk.meta, "ok")[0] == 3  # no record key: runs every time


@pytest.mark.parametrize("how", ["fail", "raise"])
def test_an_error_is_not_recorded(probe, how):
    r, name, pk = probe
    record = library.record_key(pk.meta, "e1")
    for run in (1, 2):
        with pytest.raises(redis.ResponseError, match=f"probe (failed|raised) on run {run}"):
            r.execute_command("FCALL", name, 2, pk.meta, record, how)
    assert not r.exists(record)


def test_a_record_key_outside_the_partition_is_refused(probe):
    r, name, pk = probe
    with pytest.raises(redis.ResponseError, match="the last key must be the request record"):
        r.execute_command("FCALL", name, 2, pk.meta, f"{pk.prefix}alive", "ok")
    assert not r.exists(pk.prefix + "probe")


def test_a_claim_is_recorded_only_when_it_hands_samples_out(rclient):
    """An empty claim may run again harmlessly, so it costs no record write; a claim that handed
    samples out is recorded (its retry must return the same batch: tests/integration/test_lost_replies.py)."""
    from tests.records import is_record

    def records() -> set[bytes]:
        return {k for k in rclient.redis.scan_iter(match=f"{rclient.namespace}:*") if is_record(k)}

    assert rclient.get_meta(["x"], 1, "p", task_name="t").size == 0
    assert records() == set()  # the empty claim left nothing
    rclient.put(TensorDict({"x": torch.arange(2).reshape(2, 1)}, batch_size=[2]), partition_id="p")
    after_put = records()
    assert after_put  # the put's calls
    assert rclient.get_meta(["x"], 2, "p", task_name="t").size == 2
    claimed = records() - after_put
    assert len(claimed) == 1
    assert rclient.get_meta(["x"], 1, "p", task_name="t").size == 0  # nothing left: not recorded
    assert records() - after_put == claimed
