--[[
  reserve: allocate `count` new sample ids for an insert, after checking the fields' schemas.
  Ids come from a counter that survives clears, so an id is never handed out twice. Nothing else
  is written: the client stores the bytes under the new ids, then calls `insert`. A rate limiter
  of the partition (includes/ratelimit.lua) may hold the insert back: then nothing is allocated
  and, with a waiter, the caller is registered to be woken by a consumer's claim (it BLPOPs
  <p>:admitwake).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  count               number of ids to allocate (>= 1)
    ARGV[2]  waiter              '' or the caller's waiter id (registered when a rate limiter refuses)
    ARGV[3]  wait_ms             how long that waiter waits at most
    ARGV[2k+2], ARGV[2k+3]       field name, canonical schema JSON (k = 1..)
  Output:
    {1, first_id}                ids first_id .. first_id + count - 1 are reserved
    {0, field, registered}       a field's schema conflicts; nothing allocated
    {-3}                         the partition is sealed (its producers promised no more samples)
    {-4}                         the partition was sealed and cleared (closed until reopen_partition)
    {-6, task, inserts, samples, timeout_ms}
                                 held back by `task`'s rate limiter at these counts; nothing
                                 allocated (timeout_ms: how long the limiter lets an insert wait,
                                 '' = no limit)
  Touches:
    <p>:meta  <p>:seq  <p>:fields  <p>:closed  <p>:ratelimit  <p>:admitwaiters
]]
-- @include prefix
-- @include ratelimit
-- @include schemas

local function reserve(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local count = tonumber(ARGV[1])
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then return {-3} end
  if redis.call('EXISTS', prefix .. 'closed') == 1 then return {-4} end
  local refused = schema_refusal(prefix, {unpack(ARGV, 4)})
  if refused then return refused end
  local held = insert_held(prefix, count, ARGV[2], ARGV[3])
  if held then return held end
  local next_id = redis.call('INCRBY', prefix .. 'seq', count)
  return {1, next_id - count}
end
