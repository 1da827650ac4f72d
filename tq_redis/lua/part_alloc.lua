--[[
  part_alloc: the first step of an append whose values go to a store (see includes/parts.lua).
  Hands out the next part index of each sample and field and registers the hidden field of each
  index before any byte is stored, so bytes of a producer that dies before part_append are a
  registered field of the sample: its clear deletes them. The partition stops being `inlineonly`
  (see insert.lua) for the same reason.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  nfields
    ARGV[2..1+3*nfields]         field name, part schema JSON, field schema JSON (kind "parts")
    then                         nids, then nids sample ids
  Output:
    {1, k...}                    part indexes, field-major (nids per field)
    {-1}                         the partition does not exist
    {-2, id...}                  these ids are not alive; nothing written
    {-3, field, id...}           the field is complete (marked) for these ids; nothing written
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tagnames  <p>:tag:<name>
]]
-- @include alive
-- @include parts
-- @include prefix

local function part_alloc(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local spec, at = parts_fields(ARGV, 1)
  local nids = tonumber(ARGV[at])
  local ids = {}
  for i = 1, nids do ids[i] = tonumber(ARGV[at + i]) end
  local refused = missing_reply(prefix, ids)
  if refused then return refused end
  local done = parts_completed(prefix, spec[1], ids)
  if done then
    table.insert(done, 1, -3)
    return done
  end
  redis.call('HDEL', KEYS[1], 'inlineonly')
  local out = {1}
  for f = 1, #spec[1] do
    local ks = parts_take(prefix, spec[1][f], ids)
    parts_register(prefix, spec[1][f], spec[2][f], spec[3][f], ks)
    for i = 1, #ks do out[#out + 1] = ks[i] end
  end
  return out
end
