--[[
  ready: the ready set of a task: alive AND every requested field produced AND NOT consumed by the
  task. Two ways to read it:
  - `ready_scanner` streams ready ids in ascending order straight from the bitmaps, a window at a
    time; BITPOS skips (in C) every run that cannot hold a ready id, so a claim costs
    O(ids examined + words skipped), whatever the partition size. The claim script uses it,
    through `take_ready` for its common case (one window, no stream built).
  - `compute_ready` materialises the whole ready bitmap with BITOP (O(partition)); the
    user-sampler path, which must hand the full ready list to Python, and `progress` use it.

  Offers:
    ready_scanner(prefix, task, fields, on_fill, from_byte)  a stream of ready ids: next / unread / take
    take_ready(prefix, task, fields, want, out)   the first `want` ready ids (a claim's common case)
    any_unconsumed(prefix, task)                  whether some alive sample is not consumed by the task
    compute_ready(prefix, task, fields)           scratch key holding the ready bitmap, or nil
    byte_and(a, b), BYTE_BIT, SCAN_MIN_BYTES, SCAN_MAX_BYTES, must_be_set, read_window,
    decode_window, window_bytes                    their parts
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:cons:<task>  <p>:fields
    <p>:tmp:ready  <p>:tmp:overlap               (compute_ready; the caller DELs tmp:ready)
]]
-- @include bits

-- BYTE_BIT[o] is the value of bit offset o (0 = most significant) within a byte.
local BYTE_BIT = {}
for o = 0, 7 do BYTE_BIT[o] = 2 ^ (7 - o) end

-- a AND b for byte values, without the `bit` library (fakeredis lacks it). The fast cases
-- (0, 255, equal) cover almost every byte of a claim; mixed bytes decode their set bits.
local function byte_and(a, b)
  if a == 255 then return b end
  if b == 255 or a == b then return a end
  if a == 0 or b == 0 then return 0 end
  local r = 0
  local offsets = SET_BITS[a]
  for k = 1, #offsets do
    local p = BYTE_BIT[offsets[k]]
    if math.floor(b / p) % 2 == 1 then r = r + p end
  end
  return r
end

-- Returns the scratch key holding the ready bitmap, or nil if a field is not registered yet.
-- The caller must DEL the key before returning. No BITOP NOT: its result is only as long as
-- the consumed bitmap, which would hide newer samples.
local function compute_ready(prefix, task, fields)
  local prods = {}
  if #fields > 0 then
    local schemas = redis.call('HMGET', prefix .. 'fields', unpack(fields))
    for i = 1, #fields do
      if not schemas[i] then return nil end
      prods[i] = prefix .. 'prod:' .. fields[i]
    end
  end
  local ready, overlap = prefix .. 'tmp:ready', prefix .. 'tmp:overlap'
  redis.call('BITOP', 'AND', ready, prefix .. 'alive', unpack(prods))
  redis.call('BITOP', 'AND', overlap, ready, prefix .. 'cons:' .. task)
  redis.call('BITOP', 'XOR', ready, ready, overlap)
  redis.call('DEL', overlap)
  return ready
end

local SCAN_MIN_BYTES, SCAN_MAX_BYTES = 32, 4096

-- The bitmaps every ready id has a set bit in: alive, then prod:<field> of each field.
local function must_be_set(prefix, fields)
  local ones = {prefix .. 'alive'}
  for i = 1, #fields do ones[i + 1] = prefix .. 'prod:' .. fields[i] end
  return ones
end

-- Bytes [b, b + nbytes) of each must-be-set bitmap (a table) and of the consumed bitmap.
-- GETRANGE past a bitmap's end reads as fewer (or zero) bytes.
local function read_window(ones, cons, b, nbytes)
  local e = b + nbytes - 1
  local strs = {}
  for i = 1, #ones do strs[i] = redis.call('GETRANGE', ones[i], b, e) end
  return strs, redis.call('GETRANGE', cons, b, e)
end

-- Append the ready ids of a window read at byte b (see read_window) to buf, which holds `tail`
-- ids, ascending. Stops after the byte that brings buf to `hint` ids, leaving the rest of the
-- window undecoded (a batch of 1 decodes one byte, not the window); bytes past the shortest
-- must-be-set bitmap hold no ready id. Returns the new tail and the first byte not decoded.
-- With `exact`, buf stops at exactly `hint` ids, within a byte if need be: for a caller that
-- does not read on from the returned byte (a byte's other ready ids are then left out, and
-- appending them only to drop them again grew the table for nothing).
local function decode_window(strs, cs, b, nbytes, buf, tail, hint, exact)
  local stop = nbytes
  for i = 1, #strs do stop = math.min(stop, #strs[i]) end
  for j = 1, stop do
    local r = 255
    for i = 1, #strs do
      local v = string.byte(strs[i], j) or 0
      if v ~= 255 then
        r = byte_and(r, v)
        if r == 0 then break end
      end
    end
    if r ~= 0 then
      local c = string.byte(cs, j) or 0
      if c ~= 0 then r = r - byte_and(r, c) end
      if r ~= 0 then
        local base = (b + j - 1) * 8
        local offsets = SET_BITS[r]
        for k = 1, #offsets do
          tail = tail + 1
          buf[tail] = base + offsets[k]
          if exact and tail >= hint then return tail, b + j end
        end
        if tail >= hint then return tail, b + j end
      end
    end
  end
  return tail, b + stop
end

-- Window size in bytes for a read that expects to need `hint` more ids; `grow` doubles it while
-- a claim keeps reading (filters may reject many ids).
local function window_bytes(hint, grow)
  return math.min(SCAN_MAX_BYTES, grow * math.max(SCAN_MIN_BYTES, math.ceil(hint / 8) + 1))
end

--[[
  A stream of the task's ready ids, ascending. Returns a table with
    next(hint)   the next ready id, or nil when there is none; `hint` (optional) is how many ids
                 the caller still expects to need, which sizes the next window read
    unread()     push the id last returned by next() back (one step only)
    take(k, out, count)  append up to k ids to `out` (holding `count`); returns the new count
  and, if `on_fill` is given, calls on_fill(ids, from, to) for every window of ids read (so a
  sampler can HMGET the tags of a whole window in one call). `from_byte` (optional) starts the
  stream at that byte with full alignment, after a window the caller decoded itself.
]]
local function ready_scanner(prefix, task, fields, on_fill, from_byte)
  local ones = must_be_set(prefix, fields)
  local cons = prefix .. 'cons:' .. task
  -- No STRLEN up front (each redis.call costs the claim about a microsecond): BITPOS answers
  -- -1 past the end of a must-be-set bitmap, and GETRANGE past an end reads as zero bytes.
  local byte, exhausted = from_byte or 0, false
  local buf, head, tail = {}, 1, 0
  local grow = 1

  -- Leapfrog: the first byte >= b where every must-be-set bitmap has a set bit and the
  -- consumed bitmap a clear bit (byte granularity), or nil when there is none.
  -- The consumed bitmap goes first: where a task drained a prefix, its first clear bit is the
  -- answer, and the must-be-set bitmaps confirm it without moving (3 BITPOS for one field).
  local function align(b)
    while true do
      -- A clear bit of `cons` at or after byte b; -1 means b is past its end, where every bit
      -- is implicitly clear.
      local nb = b
      local p = redis.call('BITPOS', cons, 0, b)
      if p >= 0 then nb = math.max(b, math.floor(p / 8)) end
      local moved = false
      for i = 1, #ones do
        p = redis.call('BITPOS', ones[i], 1, nb)
        if p < 0 then return nil end
        local pb = math.floor(p / 8)
        if pb > nb then
          nb, moved = pb, true
        end
      end
      if not moved then return nb end -- byte nb: a clear consumed bit and every set bit needed
      b = nb
    end
  end

  -- The first window is read optimistically where the task's first unconsumed id lies: a
  -- task that keeps up with its producers finds ready ids there, and the must-be-set bitmaps'
  -- BITPOS calls are saved. A window that yields nothing turns the full alignment on.
  local optimistic = from_byte == nil

  local function fill(hint)
    buf, head, tail = {}, 1, 0
    while not exhausted do
      local b
      if optimistic then
        optimistic = false
        local p = redis.call('BITPOS', cons, 0, byte)
        b = (p >= 0) and math.max(byte, math.floor(p / 8)) or byte
      else
        b = align(byte)
      end
      if b == nil then
        exhausted = true
        return
      end
      local nbytes = window_bytes(hint, grow)
      grow = grow * 2
      local strs, cs = read_window(ones, cons, b, nbytes)
      tail, byte = decode_window(strs, cs, b, nbytes, buf, 0, hint)
      if tail > 0 then
        if on_fill then on_fill(buf, 1, tail) end
        return
      end
    end
  end

  local scanner = {}
  function scanner.next(hint)
    if head > tail then
      fill(hint or 64)
      if head > tail then return nil end
    end
    local x = buf[head]
    head = head + 1
    return x
  end
  function scanner.unread()
    head = head - 1
  end
  -- Append up to k ids to `out` (which holds `count` ids); returns the new count.
  function scanner.take(k, out, count)
    local stop = count + k
    while count < stop do
      if head > tail then
        fill(stop - count)
        if head > tail then break end
      end
      local m = math.min(tail - head + 1, stop - count)
      for i = 0, m - 1 do out[count + 1 + i] = buf[head + i] end
      count = count + m
      head = head + m
    end
    return count
  end
  return scanner
end

-- Append up to `want` of the task's first ready ids to `out` (empty); returns how many: what
-- ready_scanner(prefix, task, fields).take(want, out, 0) returns, without building a stream for
-- the common claim, whose whole batch lies in the window at the task's first unconsumed byte.
-- Only a window holding too few goes on with a stream (full alignment) from the byte after it.
local function take_ready(prefix, task, fields, want, out)
  local cons = prefix .. 'cons:' .. task
  local p = redis.call('BITPOS', cons, 0, 0)
  local b = (p >= 0) and math.floor(p / 8) or 0
  local nbytes = window_bytes(want, 1)
  local strs, cs = read_window(must_be_set(prefix, fields), cons, b, nbytes)
  local count, after = decode_window(strs, cs, b, nbytes, out, 0, want, true)
  if count >= want then return want end -- exactly `want`: the stream is not read on
  return ready_scanner(prefix, task, fields, nil, after).take(want - count, out, count)
end

-- Whether some alive sample is not consumed by `task`, whatever its fields: what a waiter of the
-- task could still claim once its fields are produced (a few BITPOS calls).
local function any_unconsumed(prefix, task)
  return take_ready(prefix, task, {}, 1, {}) > 0
end
