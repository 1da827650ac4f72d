--[[
  Bitmap helpers shared by the scripts. Redis numbers bits from the most significant bit of byte 0,
  so sample id i lives at bit offset i. Written without the `bit` library (fakeredis lacks it).
]]

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

-- BITFIELD takes one op per id; cap ops per call so unpack() stays within Lua's C stack.
local BITFIELD_CHUNK = 1000

-- Set (value 1) or clear (value 0) the bits of `ids` in `key`.
local function set_bits(key, ids, value)
  local args, n = {}, 0
  for i = 1, #ids do
    args[n + 1] = 'SET'; args[n + 2] = 'u1'; args[n + 3] = ids[i]; args[n + 4] = value
    n = n + 4
    if n >= BITFIELD_CHUNK * 4 then
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
    if n >= BITFIELD_CHUNK * 3 then flush() end
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

-- Offsets of the first `want` set bits of `key` (fewer if the bitmap has fewer).
-- Cost: BITPOS skips zero runs in C; GETRANGE chunks are decoded with SET_BITS.
local function first_set_bits(key, want)
  local out, n = {}, 0
  if want <= 0 then return out end
  local pos = redis.call('BITPOS', key, 1)
  if pos < 0 then return out end
  local len = redis.call('STRLEN', key)
  local byte = math.floor(pos / 8)
  while n < want and byte < len do
    local chunk_end = math.min(len - 1, byte + math.max(128, want - n))
    local s = redis.call('GETRANGE', key, byte, chunk_end)
    for i = 1, #s do
      local b = string.byte(s, i)
      if b ~= 0 then
        local base = (byte + i - 1) * 8
        local offsets = SET_BITS[b]
        for k = 1, #offsets do
          n = n + 1
          out[n] = base + offsets[k]
          if n >= want then return out end
        end
      end
    end
    byte = chunk_end + 1
    if byte < len then
      pos = redis.call('BITPOS', key, 1, byte)
      if pos < 0 then break end
      byte = math.floor(pos / 8)
    end
  end
  return out
end

-- Every set bit of `key`, in order.
local function all_set_bits(key)
  return first_set_bits(key, redis.call('BITCOUNT', key))
end
