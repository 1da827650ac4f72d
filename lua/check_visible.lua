--[[
  check_visible: after a client read samples' bytes, prove they belong to live samples whose
  fields are produced (bits are cleared before bytes are deleted, so bits still set now mean the
  bytes read were valid). Ids travel as ranges, so a contiguous batch costs one BITCOUNT per key.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048,4000-4010"
    ARGV[2..]                    field names
  Output:
    {0}                          every id is alive and has every field
    {-1, id...}                  these ids are not alive (cleared or never inserted)
    {-2, field, id...}           the field is not produced for these ids
  Touches:
    <p>:alive  <p>:prod:<field>
]]
-- @include bits
-- @include prefix
-- @include visibility

local function check_visible(KEYS, ARGV)
  return visibility(partition_prefix(KEYS[1]), parse_ranges(ARGV[1]), {unpack(ARGV, 2)})
end
