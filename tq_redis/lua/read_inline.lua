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
                                 (a member of a group-shared field gets its carrier's inline value,
                                 see includes/shares.lua)
    {0, values, refs, carriers, placement}
                                 the same when some shared values live in a store: refs field-major
                                 like values, the carrier id where the value is the carrier's store
                                 value (false elsewhere); carriers those ids ascending, and
                                 placement(prefix, carriers, fields) (includes/placement.lua)
    {-1, id...}                  these ids are not alive (cleared or never inserted)
    {-2, field, id...}           the field is not produced for these ids
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:inline  <p>:shared  <p>:share:<field>  <p>:rings  <p>:loc:<field>
]]
-- @include bits
-- @include inline
-- @include prefix
-- @include shares
-- @include visibility

local function read_inline(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  local fields = {unpack(ARGV, 2)}
  local verdict = visibility(prefix, ranges, fields)
  if verdict[1] ~= 0 then return verdict end
  local ids = range_ids(ranges)
  local values = inline_get(prefix, ids, fields)
  if not shares_exist(prefix) then return {0, values} end
  return share_values(prefix, ids, fields, values)
end
