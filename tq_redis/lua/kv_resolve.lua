--[[
  kv_resolve: map user keys of a partition to sample ids (the KV API), giving unknown keys fresh,
  never-reused ids when asked. A key whose sample was cleared counts as unknown. A fresh sample is
  alive with no field produced, so no consumer can claim it before a put stores its bytes.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  create              '1': unknown keys get fresh ids; '0': look up only
    ARGV[2]  now_ms              creation time if this call creates the partition
    ARGV[3]  waiter              '' or the caller's waiter id, registered when a rate limiter
    ARGV[4]  wait_ms             refuses the new keys (see `reserve`), for at most wait_ms
    ARGV[5]  nkeys
    ARGV[6..5+nkeys]             user keys (unique)
    ARGV[6+nkeys..]              field name, canonical schema JSON pairs checked before creating
  Output:
    {1, ids, created, common, tags}
      ids                        sample id per key, -1 where the key is unknown (create = '0')
      created                    how many keys got a fresh id
      common                     flat {field, schema JSON, ...}: fields produced for every key
                                 with an id (none if this call created a key: it has no field)
      tags                       flat {tag name, {JSON value or false per key}, ...}
    {0, field, registered}       a field's schema conflicts with the registered one; nothing written
    {-1}                         the partition does not exist (create = '0')
    {-4}                         the partition was sealed and cleared (closed until reopen_partition);
                                 nothing written (create = '1')
    {-6, task, inserts, samples, timeout_ms}
                                 new keys held back by a rate limiter, as `reserve`; nothing written
  Touches:
    <p>:closed  <p>:meta  <p>:seq  <p>:alive  <p>:fields  <p>:prod:<field>
    <p>:tagnames  <p>:tag:<name>
    <p>:kv  <p>:kvkeys  <p>:ratelimit  <p>:admitwaiters
]]
-- @include bits
-- @include chunks
-- @include prefix
-- @include ratelimit
-- @include schemas
-- @include tags

local function kv_resolve(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local create = ARGV[1] == '1'
  local nkeys = tonumber(ARGV[5])
  local keys, schemas = {}, {}
  for i = 1, nkeys do keys[i] = ARGV[5 + i] end
  for i = 6 + nkeys, #ARGV do schemas[#schemas + 1] = ARGV[i] end
  if redis.call('EXISTS', KEYS[1]) == 0 and not create then return {-1} end
  if create and redis.call('EXISTS', prefix .. 'closed') == 1 then return {-4} end
  if create then
    local refused = schema_refusal(prefix, schemas)
    if refused then return refused end
  end

  -- Known keys whose sample is still alive keep their id; the others are unknown.
  local mapped = hmget_many(prefix .. 'kv', keys)
  local known, known_pos = {}, {}
  for i = 1, nkeys do
    if mapped[i] then
      known[#known + 1] = tonumber(mapped[i])
      known_pos[#known_pos + 1] = i
    end
  end
  local ids, existing, stale, missing = {}, {}, {}, {}
  for i = 1, nkeys do ids[i] = -1 end
  local alive = get_bits(prefix .. 'alive', known)
  for j = 1, #known do
    if alive[j] == 1 then
      ids[known_pos[j]] = known[j]
      existing[#existing + 1] = known[j]
    else
      stale[#stale + 1] = known[j]
    end
  end
  for i = 1, nkeys do
    if ids[i] == -1 then missing[#missing + 1] = i end
  end

  local created = 0
  if create and #missing > 0 then
    local held = insert_held(prefix, #missing, ARGV[3], ARGV[4])
    if held then return held end
    created = #missing
    local first = redis.call('INCRBY', prefix .. 'seq', created) - created
    local fwd, rev = {}, {}
    for j = 1, created do
      local id = first + j - 1
      ids[missing[j]] = id
      fwd[#fwd + 1] = keys[missing[j]]; fwd[#fwd + 1] = id
      rev[#rev + 1] = id; rev[#rev + 1] = keys[missing[j]]
      if #fwd >= 2 * CHUNK then
        redis.call('HSET', prefix .. 'kv', unpack(fwd))
        redis.call('HSET', prefix .. 'kvkeys', unpack(rev))
        fwd, rev = {}, {}
      end
    end
    if #fwd > 0 then
      redis.call('HSET', prefix .. 'kv', unpack(fwd))
      redis.call('HSET', prefix .. 'kvkeys', unpack(rev))
    end
    for from = 1, #stale, CHUNK do
      redis.call('HDEL', prefix .. 'kvkeys', unpack(stale, from, math.min(#stale, from + CHUNK - 1)))
    end
    set_bit_range(prefix .. 'alive', first, created)
    redis.call('HSETNX', KEYS[1], 'created_ms', ARGV[2])
    redis.call('HINCRBY', KEYS[1], 'samples', created)
  end

  local common = {}
  if #existing > 0 and created == 0 then
    local registered = redis.call('HGETALL', prefix .. 'fields')
    for i = 1, #registered, 2 do
      local bits = get_bits(prefix .. 'prod:' .. registered[i], existing)
      local all = true
      for j = 1, #bits do
        if bits[j] == 0 then all = false; break end
      end
      if all then
        common[#common + 1] = registered[i]
        common[#common + 1] = registered[i + 1]
      end
    end
  end
  return {1, ids, created, common, read_tags(prefix, ids)}
end
