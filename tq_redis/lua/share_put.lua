--[[
  share_put: make one value per field the value of every member of a group (a field shared by a
  GRPO group: the same prompt or image for its n samples), stored once under a carrier id (see
  includes/shares.lua). Data first, then bits: store values are stored under the carrier (from
  share_begin) before this runs; small values come inline and get their carrier here. The members
  become produced for the fields at once, like a produce.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  carrier             from share_begin (store values), or '' (inline values: allocated here)
    ARGV[2]  ring                the store's ring the values were put under, '' if none (or inline)
    ARGV[3]  members             ids as comma-separated ranges, e.g. "0-7"
    ARGV[4]  nfields
    ARGV[5..4+2*nfields]         field name, canonical schema JSON pairs
    then                         with carrier '': one inline value per field
  Output:
    {1, carrier}                 linked: every member reads the carrier's values, `produced` emitted
    {-1}                         the partition does not exist
    {-2, id...}                  these members are not alive; nothing written
    {-5, field, id...}           the field is produced for these members already (a shared field is
                                 put once, before any member has it); nothing written
    {0, field, registered}       a field's schema conflicts; nothing written
  Touches:
    <p>:meta  <p>:seq  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:inline  <p>:rings  <p>:loc:<field>
    <p>:shared  <p>:share:<field>  <p>:carriers  <p>:sharepending
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include alive
-- @include bits
-- @include chunks
-- @include events
-- @include inline
-- @include placement
-- @include prefix
-- @include schemas
-- @include visibility

local function share_put(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local ids = range_ids(parse_ranges(ARGV[3]))
  local nfields = tonumber(ARGV[4])
  local pairs_ = {unpack(ARGV, 5, 4 + 2 * nfields)}
  local refused = missing_reply(prefix, ids) or schema_refusal(prefix, pairs_)
  if refused then return refused end
  local names = {}
  for i = 1, #pairs_, 2 do names[#names + 1] = pairs_[i] end
  for f = 1, #names do
    local bits = get_bits(prefix .. 'prod:' .. names[f], ids)
    local has = {}
    for i = 1, #ids do
      if bits[i] == 1 then has[#has + 1] = ids[i] end
    end
    if #has > 0 then return {-5, names[f], unpack(has)} end
  end

  register_schemas(prefix, pairs_)
  local carrier
  if ARGV[1] == '' then
    carrier = redis.call('INCRBY', prefix .. 'seq', 1) - 1
    inline_put(prefix, {carrier}, names, ARGV, 5 + 2 * nfields)
  else
    carrier = tonumber(ARGV[1])
    redis.call('SETBIT', prefix .. 'sharepending', carrier, 0)
    if redis.call('BITCOUNT', prefix .. 'sharepending') == 0 then redis.call('DEL', prefix .. 'sharepending') end
    redis.call('HSET', prefix .. 'carriers', carrier .. ':s', 1)
    redis.call('HDEL', KEYS[1], 'inlineonly')
    place_ids(prefix, ARGV[2], names, {carrier})
  end
  redis.call('HINCRBY', prefix .. 'carriers', carrier, #ids * #names)
  redis.call('SADD', prefix .. 'shared', unpack(names))
  for f = 1, #names do
    local key = prefix .. 'share:' .. names[f]
    for from = 1, #ids, CHUNK do
      local args = {}
      for i = from, math.min(#ids, from + CHUNK - 1) do
        args[#args + 1] = ids[i]
        args[#args + 1] = carrier
      end
      redis.call('HSET', key, unpack(args))
    end
    set_bits(prefix .. 'prod:' .. names[f], ids, 1)
  end
  emit(prefix, 'produced', 'count', #ids, 'fields', table.concat(names, ','))
  return {1, carrier}
end
