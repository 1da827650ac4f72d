--[[
  kv_list: every user key of a partition whose sample is alive, with its sample id and tags.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
  Output:
    {keys, ids, tags}            tags = flat {tag name, {JSON value or false per key}, ...};
                                 {{}, {}, {}} if the partition does not exist
  Touches:
    <p>:meta  <p>:alive
    <p>:tagnames  <p>:tag:<name>
    <p>:kv
]]
-- @include bits
-- @include prefix
-- @include tags

local function kv_list(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {{}, {}, {}} end
  local flat = redis.call('HGETALL', prefix .. 'kv')
  local keys, ids = {}, {}
  for i = 1, #flat, 2 do
    keys[#keys + 1] = flat[i]
    ids[#ids + 1] = tonumber(flat[i + 1])
  end
  local alive = get_bits(prefix .. 'alive', ids)
  local live_keys, live_ids = {}, {}
  for i = 1, #ids do
    if alive[i] == 1 then
      live_keys[#live_keys + 1] = keys[i]
      live_ids[#live_ids + 1] = ids[i]
    end
  end
  return {live_keys, live_ids, read_tags(prefix, live_ids)}
end
