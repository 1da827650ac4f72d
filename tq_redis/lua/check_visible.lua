--[[
  check_visible: after a client read samples' bytes, prove they belong to live samples whose
  fields are produced (bits are cleared before bytes are deleted, so bits still set now mean the
  bytes read were valid). Ids travel as ranges, so a contiguous batch costs one BITCOUNT per key.
  Asked to, it also says where the values were put (includes/placement.lua), so a client that
  read them from a store that places keys itself can tell whether it asked their holders.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048,4000-4010"
    ARGV[2]  placement           '1': add the values' placement to a {0} reply; '': do not
    ARGV[3..]                    field names
  Output:
    {0}                          every id is alive and has every field
    {0, placement}               the same, with placement(prefix, ranges, fields) (see
                                 includes/placement.lua), when asked for
    {-1, id...}                  these ids are not alive (cleared or never inserted)
    {-2, field, id...}           the field is not produced for these ids
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:rings  <p>:loc:<field>
]]
-- @include bits
-- @include placement
-- @include prefix
-- @include visibility

local function check_visible(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  local fields = {unpack(ARGV, 3)}
  local verdict = visibility(prefix, ranges, fields)
  if verdict[1] ~= 0 or ARGV[2] ~= '1' then return verdict end
  return {0, placement(prefix, ranges, fields)}
end
