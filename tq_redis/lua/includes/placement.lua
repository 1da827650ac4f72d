--[[
  placement: where a partition's values live in a store that places keys itself (the DRAM store
  hashes each key over the ring of live nodes, which changes as nodes join, leave or restart).
  The client names the ring it put a batch under (its id; the ring's members are in
  <ns>:storage:rings); the script that makes the values visible records it here, so a reader or
  a clear finds each value on its holder whatever the ring is now.

  <p>:rings maps each ring id the partition's store values were put under to its index (0, 1,
  ...). <p>:loc:<field> holds 2 bytes (little-endian) per sample id: the index of the ring the
  sample's value of that field was put under. Index 0 needs no entry, so while every value went to
  the partition's first ring no loc key exists and recording costs one HGET.

  Offers:
    place_range(prefix, ring, fields, first, count)   record ids first .. first + count - 1
    place_ids(prefix, ring, fields, ids)              record ids (any order)
    ring_index(prefix, ring)                          the ring's index (a new ring gets the next)
    loc_code(index)                                   an index as its 2 loc bytes
    placement(prefix, ranges, fields)                 {ring id, index, ... (HGETALL)} then, per
                                                      field, the loc bytes of the ranges' ids
                                                      (2 per id, ascending) or false if none
  Touches:
    <p>:rings  <p>:loc:<field>
]]

local function ring_index(prefix, ring)
  local index = redis.call('HGET', prefix .. 'rings', ring)
  if index then return tonumber(index) end
  index = redis.call('HLEN', prefix .. 'rings')
  redis.call('HSET', prefix .. 'rings', ring, index)
  return index
end

local function loc_code(index)
  return string.char(index % 256, math.floor(index / 256) % 256)
end

local function place_range(prefix, ring, fields, first, count)
  if ring == '' or count <= 0 then return end
  local index = ring_index(prefix, ring)
  local code = loc_code(index)
  for i = 1, #fields do
    local key = prefix .. 'loc:' .. fields[i]
    if index ~= 0 or redis.call('EXISTS', key) == 1 then
      redis.call('SETRANGE', key, 2 * first, string.rep(code, count))
    end
  end
end

local function place_ids(prefix, ring, fields, ids)
  if ring == '' or #ids == 0 then return end
  local index = ring_index(prefix, ring)
  local code = loc_code(index)
  local sorted = {}
  for i = 1, #ids do sorted[i] = ids[i] end
  table.sort(sorted)
  for f = 1, #fields do
    local key = prefix .. 'loc:' .. fields[f]
    if index ~= 0 or redis.call('EXISTS', key) == 1 then
      local i = 1
      while i <= #sorted do
        local j = i
        while j < #sorted and sorted[j + 1] <= sorted[j] + 1 do j = j + 1 end
        redis.call('SETRANGE', key, 2 * sorted[i], string.rep(code, sorted[j] - sorted[i] + 1))
        i = j + 1
      end
    end
  end
end

local function placement(prefix, ranges, fields)
  local rings = redis.call('HGETALL', prefix .. 'rings')
  local out = {rings}
  if #rings == 0 then return out end
  for f = 1, #fields do
    local key = prefix .. 'loc:' .. fields[f]
    if redis.call('EXISTS', key) == 0 then
      out[f + 1] = false
    else
      local parts = {}
      for i = 1, #ranges do
        local want = 2 * (ranges[i][2] - ranges[i][1] + 1)
        local got = redis.call('GETRANGE', key, 2 * ranges[i][1], 2 * ranges[i][2] + 1)
        if #got < want then got = got .. string.rep('\0', want - #got) end  -- past the end: index 0
        parts[i] = got
      end
      out[f + 1] = table.concat(parts)
    end
  end
  return out
end
