--[[
  share_begin: allocate the carrier id of a group-shared value whose bytes go to a store (see
  includes/shares.lua), before they are stored. The carrier is marked pending, so a writer killed
  between storing the bytes and share_put leaves them findable: drop_partition moves pending
  carriers to the trash. Small values skip this: share_put allocates their carrier itself.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1..]                    field name, canonical schema JSON pairs (checked, not registered)
  Output:
    {1, carrier}                 the carrier id (from the partition's id counter)
    {-1}                         the partition does not exist
    {0, field, registered}       a field's schema conflicts; nothing allocated
  Touches:
    <p>:meta  <p>:seq  <p>:fields  <p>:sharepending  <p>:trashfields
]]
-- @include prefix
-- @include schemas

local function share_begin(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local refused = schema_refusal(prefix, ARGV)
  if refused then return refused end
  local carrier = redis.call('INCRBY', prefix .. 'seq', 1) - 1
  redis.call('SETBIT', prefix .. 'sharepending', carrier, 1)
  local names = {}
  for i = 1, #ARGV, 2 do names[#names + 1] = ARGV[i] end
  redis.call('SADD', prefix .. 'trashfields', unpack(names))
  return {1, carrier}
end
