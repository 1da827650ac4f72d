--[[
  read_inline: get_data's one round trip for small values: the visibility check of check_visible
  and, when every id is visible, the values kept inline (see includes/inline.lua). Values that
  live in a store come back as false; the client reads those from the store and checks them with
  check_visible afterwards (bytes before bits).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048,4000-4010"
    ARGV[2..]                    field names
  Output:
    {0, values}                  every id is alive and has every field; values field-major over
                                 the ids in ascending order, false where the value is not inline
    {-1, id...}                  these ids are not alive (cleared or never inserted)
    {-2, field, id...}           the field is not produced for these ids
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:inline
]]
-- @include bits
-- @include inline
-- @include prefix
-- @include visibility

local function read_inline(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  local fields = {unpack(ARGV, 2)}
  local verdict = visibility(prefix, ranges, fields)
  if verdict[1] ~= 0 then return verdict end
  return {0, inline_get(prefix, range_ids(ranges), fields)}
end
