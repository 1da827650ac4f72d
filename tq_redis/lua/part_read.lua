--[[
  part_read: what get_data needs of a field written in parts (see includes/parts.lua): the
  visibility check of check_visible (alive, and the field marked complete) and, when it passed,
  each sample's parts ([policy_version, length, k] in order) and the values of those kept inline.
  Parts in a store come back as false; the client reads them and checks them with check_visible
  afterwards (bytes before bits).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048"
    ARGV[2]  field name
  Output:
    {0, parts, values}           parts: per id (ascending) its "<f>~parts" JSON (false if none);
                                 values: per id, per part in order, the inline value or false
    {-1, id...}                  these ids are not alive (cleared or never inserted)
    {-2, field, id...}           the field is not complete for these ids
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:tag:<name>  <p>:inline
]]
-- @include bits
-- @include chunks
-- @include parts
-- @include prefix
-- @include visibility

local function part_read(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  local field = ARGV[2]
  local verdict = visibility(prefix, ranges, {field})
  if verdict[1] ~= 0 then return verdict end
  local ids = range_ids(ranges)
  local parts = hmget_many(prefix .. 'tag:' .. field .. '~parts', ids)
  local names = {}
  for i = 1, #ids do
    if parts[i] then
      local list = cjson.decode(parts[i])
      for j = 1, #list do names[#names + 1] = ids[i] .. ':' .. part_name(field, list[j][3]) end
    end
  end
  local values = {}
  if #names > 0 and redis.call('EXISTS', prefix .. 'inline') == 1 then
    values = hmget_many(prefix .. 'inline', names)
  end
  return {0, parts, values}
end
