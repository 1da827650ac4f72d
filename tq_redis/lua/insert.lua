--[[
  insert: make new samples visible with the fields whose bytes are stored. Two ways in:
  - after `reserve` (first_id given): the client stored every value in its store first (data
    first, then bits), and this script flips the bits;
  - small values inline (first_id ''): the ids are allocated here and the values stored in
    <p>:inline in the same atomic step as the bits, so a small put is one round trip.
  A partition created by an inline put is marked `inlineonly` in its meta hash until a put
  through `reserve` (values in the store) arrives: clearing it then needs no store round trip.
  A store that places keys itself names the ring it put them under (see includes/placement.lua).
  A partition that was sealed and then cleared stays closed (<p>:closed) until reopen_partition.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  first_id            from `reserve`, or '' to allocate the ids here (inline values)
    ARGV[2]  count
    ARGV[3]  now_ms              creation time for a new partition
    ARGV[4]  ring                the store's ring the values were put under, '' if none
    ARGV[5]  waiter              with first_id '': '' or the caller's waiter id, registered when
    ARGV[6]  wait_ms             a rate limiter refuses (see `reserve`), for at most wait_ms
    ARGV[7]  nfields
    ARGV[8..7+2*nfields]         nfields pairs: field name, canonical schema JSON
    ARGV[8+2*nfields..]          with first_id '': count x nfields values, field-major (every
                                 sample's value of the first field, then of the next field)
  Output:
    {1, first_id}                samples alive, fields marked produced, `insert` event emitted
    {0, field, registered}       a field's schema conflicts (with `reserve`: appeared since); nothing written
    {-3}                         the partition is sealed; nothing written
    {-4}                         the partition was sealed and cleared (closed); nothing written
    {-6, task, inserts, samples, timeout_ms}
                                 with first_id '': held back by a rate limiter, as `reserve`
  Touches:
    <p>:meta  <p>:seq  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:inline
    <p>:groups  <p>:closed  <p>:rings  <p>:loc:<field>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
    <p>:ratelimit  <p>:admitwaiters (first_id '')
]]
-- @include arrival
-- @include events
-- @include inline
-- @include placement
-- @include prefix
-- @include ratelimit
-- @include schemas

local function insert(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local count = tonumber(ARGV[2])
  local nfields = tonumber(ARGV[7])
  local pairs_ = {unpack(ARGV, 8, 7 + 2 * nfields)}
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then return {-3} end
  if redis.call('EXISTS', prefix .. 'closed') == 1 then return {-4} end
  local refused = schema_refusal(prefix, pairs_)
  if refused then return refused end

  local names = {}
  for i = 1, #pairs_, 2 do names[#names + 1] = pairs_[i] end
  local first = tonumber(ARGV[1])
  local inline = not first
  if inline then -- inline: ids from the same counter `reserve` uses, values next to the bits
    local held = insert_held(prefix, count, ARGV[5], ARGV[6])
    if held then return held end
    first = redis.call('INCRBY', prefix .. 'seq', count) - count
    local ids = {}
    for i = 1, count do ids[i] = first + i - 1 end
    inline_put(prefix, ids, names, ARGV, 8 + 2 * nfields)
  else
    place_range(prefix, ARGV[4], names, first, count)
  end
  register_schemas(prefix, pairs_)
  arrive(KEYS[1], prefix, first, count, names, inline, ARGV[3])
  emit(prefix, 'insert', 'first', first, 'count', count, 'fields', table.concat(names, ','))
  return {1, first}
end
