--[[
  reserve: allocate `count` new sample ids for an insert, after checking the fields' schemas.
  Ids come from a counter that survives clears, so an id is never handed out twice. Nothing else
  is written: the client stores the bytes under the new ids, then calls `insert`.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  count               number of ids to allocate (>= 1)
    ARGV[2k], ARGV[2k+1]         field name, canonical schema JSON (k = 1..)
  Output:
    {1, first_id}                ids first_id .. first_id + count - 1 are reserved
    {0, field, registered}       a field's schema conflicts; nothing allocated
    {-3}                         the partition is sealed (its producers promised no more samples)
    {-4}                         the partition was sealed and cleared (closed until reopen_partition)
  Touches:
    <p>:meta  <p>:seq  <p>:fields  <p>:closed
]]
-- @include prefix
-- @include schemas

local function reserve(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local count = tonumber(ARGV[1])
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then return {-3} end
  if redis.call('EXISTS', prefix .. 'closed') == 1 then return {-4} end
  local conflict = schema_conflict(prefix, {unpack(ARGV, 2)})
  if conflict then return {0, conflict[1], conflict[2]} end
  local next_id = redis.call('INCRBY', prefix .. 'seq', count)
  return {1, next_id - count}
end
