--[[
  check_visible: after a client read samples' bytes, prove they belong to live samples whose
  fields are produced (bits are cleared before bytes are deleted, so bits still set now mean the
  bytes read were valid). Ids travel as ranges, so a contiguous batch costs one BITCOUNT per key.

  Input:
    KEYS[1]  partition meta key  <ns>:{<p>}:meta
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

local function check_visible(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  local function missing(key)
    local out = {}
    for i = 1, #ranges do
      local first, last = ranges[i][1], ranges[i][2]
      if redis.call('BITCOUNT', key, first, last, 'BIT') < last - first + 1 then
        local ids = {}
        for id = first, last do ids[#ids + 1] = id end
        local bits = get_bits(key, ids)
        for j = 1, #ids do
          if bits[j] == 0 then out[#out + 1] = ids[j] end
        end
      end
    end
    return out
  end
  local gone = missing(prefix .. 'alive')
  if #gone > 0 then
    table.insert(gone, 1, -1)
    return gone
  end
  for i = 2, #ARGV do
    local absent = missing(prefix .. 'prod:' .. ARGV[i])
    if #absent > 0 then
      table.insert(absent, 1, ARGV[i])
      table.insert(absent, 1, -2)
      return absent
    end
  end
  return {0}
end
