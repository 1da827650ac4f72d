--[[
  insert: make freshly reserved samples visible, with the fields whose bytes are already stored.
  Data first, then bits: the client calls this only after every value is in its store.

  Input:
    KEYS[1]  partition meta key  <ns>:{<p>}:meta
    ARGV[1]  first_id            from `reserve`
    ARGV[2]  count
    ARGV[3]  now_ms              creation time for a new partition
    ARGV[4]  nfields
    ARGV[5..]                    nfields pairs: field name, canonical schema JSON
  Output:
    {1}                          samples alive, fields marked produced, `insert` event emitted
    {0, field, registered}       a schema conflict appeared since `reserve`; nothing written
    {-3}                         the partition was sealed since `reserve`; nothing written
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>
    <p>:groups
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
]]
-- @include bits
-- @include events
-- @include prefix
-- @include schemas

local function insert(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local first, count = tonumber(ARGV[1]), tonumber(ARGV[2])
  local nfields = tonumber(ARGV[4])
  local pairs_ = {unpack(ARGV, 5, 4 + 2 * nfields)}
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then return {-3} end
  local conflict = schema_conflict(prefix, pairs_)
  if conflict then return {0, conflict[1], conflict[2]} end

  register_schemas(prefix, pairs_)
  set_bit_range(prefix .. 'alive', first, count)
  local names = {}
  for i = 1, #pairs_, 2 do
    set_bit_range(prefix .. 'prod:' .. pairs_[i], first, count)
    names[#names + 1] = pairs_[i]
  end
  redis.call('HSETNX', KEYS[1], 'created_ms', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'samples', count)
  redis.call('HSET', prefix .. 'groups', first, count)
  emit(prefix, 'insert', 'first', first, 'count', count, 'fields', table.concat(names, ','))
  return {1}
end
