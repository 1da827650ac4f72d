--[[
  visibility: whether samples are alive and have fields produced, checked over id ranges (a
  contiguous batch costs one BITCOUNT per key; only a range with a gap is read bit by bit).

  Offers:
    visibility(prefix, ranges, fields)   {0} all visible, {-1, id...} not alive,
                                         {-2, field, id...} the field is not produced for these ids
    range_ids(ranges)                    the ids of parsed ranges, ascending
  Touches:
    <p>:alive  <p>:prod:<field>
]]
-- @include bits

local function range_ids(ranges)
  local ids = {}
  for i = 1, #ranges do
    for id = ranges[i][1], ranges[i][2] do ids[#ids + 1] = id end
  end
  return ids
end

local function visibility(prefix, ranges, fields)
  local function missing(key)
    local out = {}
    for i = 1, #ranges do
      local first, last = ranges[i][1], ranges[i][2]
      if redis.call('BITCOUNT', key, first, last, 'BIT') < last - first + 1 then
        local ids = range_ids({ranges[i]})
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
  for i = 1, #fields do
    local absent = missing(prefix .. 'prod:' .. fields[i])
    if #absent > 0 then
      table.insert(absent, 1, fields[i])
      table.insert(absent, 1, -2)
      return absent
    end
  end
  return {0}
end
