--[[
  kv_unmap: forget user keys of a partition (the KV API), each only if it still maps to the sample
  id the caller cleared, so a key re-created meanwhile by another client keeps its new sample.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[2k-1], ARGV[2k]         user key, sample id (k = 1..)
  Output:
    number of keys removed
  Touches:
    <p>:kv  <p>:kvkeys
  Flags:
    allow-oom  it only deletes: kv_clear must free memory when Redis is full
]]
-- @include prefix

local function kv_unmap(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local removed = 0
  for i = 1, #ARGV, 2 do
    if redis.call('HGET', prefix .. 'kv', ARGV[i]) == ARGV[i + 1] then
      redis.call('HDEL', prefix .. 'kv', ARGV[i])
      redis.call('HDEL', prefix .. 'kvkeys', ARGV[i + 1])
      removed = removed + 1
    end
  end
  return removed
end
