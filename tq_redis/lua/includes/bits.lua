--[[
  bits: bitmap helpers. Redis numbers bits from the most significant bit of byte 0, so sample id i
  lives at bit offset i. Written without the `bit` library (fakeredis lacks it).

  Offers:
    SET_BITS[b]                       offsets (0..7, MSB first) of the set bits of byte value b
    set_bits(key, ids, value)         set (1) or clear (0) the bits of ids (BITFIELD)
    get_bits(key, ids)                the bits of ids, 0/1 aligned with ids
    set_bit_range(key, first, count, value)  bits [first, first + count) to value (default 1)
    parse_ranges(text)                "0-1023,2048" -> {{0, 1023}, {2048, 2048}}
    set_ranges(key, text, value)      set_bit_range over every range of the text
    set_id_bits(key, ids)             set the bits of ids (any order); runs go by SETRANGE
  Touches:
    nothing of its own (keys come from the caller)
]]
-- @include chunks

-- SET_BITS[b] lists the offsets (0..7, MSB first) of the set bits of byte value b.
local SET_BITS = {}
for b = 0, 255 do
  local offsets, v = {}, b
  for i = 7, 0, -1 do
    local p = 2 ^ i
    if v >= p then
      offsets[#offsets + 1] = 7 - i
      v = v - p
    end
  end
  SET_BITS[b] = offsets
end

-- Set (value 1) or clear (value 0) the bits of `ids` in `key`.
local function set_bits(key, ids, value)
  local args, n = {}, 0
  for i = 1, #ids do
    args[n + 1] = 'SET'; args[n + 2] = 'u1'; args[n + 3] = ids[i]; args[n + 4] = value
    n = n + 4
    if n >= CHUNK * 4 then
      redis.call('BITFIELD', key, unpack(args, 1, n))
      n = 0
    end
  end
  if n > 0 then redis.call('BITFIELD', key, unpack(args, 1, n)) end
end

-- Read the bits of `ids` in `key`; returns a table of 0/1 aligned with ids.
local function get_bits(key, ids)
  local out, args, n, base = {}, {}, 0, 0
  local function flush()
    local got = redis.call('BITFIELD', key, unpack(args, 1, n))
    for j = 1, #got do out[base + j] = got[j] end
    base = base + #got
    n = 0
  end
  for i = 1, #ids do
    args[n + 1] = 'GET'; args[n + 2] = 'u1'; args[n + 3] = ids[i]
    n = n + 3
    if n >= CHUNK * 3 then flush() end
  end
  if n > 0 then flush() end
  return out
end

-- Set the bits [first, first + count) of `key` to `value` (default 1): whole bytes with SETRANGE,
-- edges bit by bit.
local function set_bit_range(key, first, count, value)
  if count <= 0 then return end
  value = value or 1
  local last = first + count - 1
  local edge = {}
  local head_end = math.min(last, math.ceil(first / 8) * 8 - 1)
  for i = first, head_end do edge[#edge + 1] = i end
  local byte_from = math.ceil(first / 8)
  local byte_to = math.floor((last + 1) / 8) - 1
  if byte_to >= byte_from then
    if value == 1 or redis.call('STRLEN', key) > byte_from then  -- zeros past the end are implied
      redis.call('SETRANGE', key, byte_from, string.rep(value == 1 and '\255' or '\0', byte_to - byte_from + 1))
    end
    for i = math.max(head_end + 1, (byte_to + 1) * 8), last do edge[#edge + 1] = i end
  else
    for i = head_end + 1, last do edge[#edge + 1] = i end
  end
  if #edge > 0 then set_bits(key, edge, value) end
end

-- Parse ids written as comma-separated ranges ("0-1023,2048,4000-4010") into {{first, last}...}.
local function parse_ranges(text)
  local ranges = {}
  for a, b in string.gmatch(text, '(%d+)%-?(%d*)') do
    local first = tonumber(a)
    ranges[#ranges + 1] = {first, b ~= '' and tonumber(b) or first}
  end
  return ranges
end

-- Set (value 1) or clear (value 0) the bits of every id in the ranges text (see parse_ranges).
local function set_ranges(key, text, value)
  local ranges = parse_ranges(text)
  for i = 1, #ranges do
    set_bit_range(key, ranges[i][1], ranges[i][2] - ranges[i][1] + 1, value)
  end
end

-- Set the bits of `ids` (any order) in `key`: whole bytes of consecutive runs with SETRANGE,
-- the rest with BITFIELD. A sequential claim of 1024 ids is a handful of calls.
local function set_id_bits(key, ids)
  -- One id (a claim of one): no run to look for, no argument table to build. BITFIELD, not
  -- SETBIT: the ACL users that earlier versions created are not granted SETBIT.
  if #ids == 1 then
    redis.call('BITFIELD', key, 'SET', 'u1', ids[1], 1)
    return
  end
  local sorted = ids
  for i = 2, #ids do
    if ids[i] < ids[i - 1] then
      sorted = {}
      for j = 1, #ids do sorted[j] = ids[j] end
      table.sort(sorted)
      break
    end
  end
  local edges = {}
  local i = 1
  while i <= #sorted do
    local j = i
    while j < #sorted and sorted[j + 1] == sorted[j] + 1 do j = j + 1 end
    local first, last = sorted[i], sorted[j]
    local byte_from, byte_to = math.ceil(first / 8), math.floor((last + 1) / 8) - 1
    if byte_to >= byte_from then
      redis.call('SETRANGE', key, byte_from, string.rep('\255', byte_to - byte_from + 1))
      for id = first, byte_from * 8 - 1 do edges[#edges + 1] = id end
      for id = (byte_to + 1) * 8, last do edges[#edges + 1] = id end
    else
      for id = first, last do edges[#edges + 1] = id end
    end
    i = j + 1
  end
  if #edges > 0 then set_bits(key, edges, 1) end
end
