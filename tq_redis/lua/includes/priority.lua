--[[
  priority: the prioritized sampler (PrioritizedSampler): `want` of the task's ready samples,
  drawn without replacement with probability proportional to priority ^ alpha. A sample's
  priority is its `priority` tag (update_priority writes it); a sample without one has priority
  1; one whose priority is not a positive number (or whose weight overflows) is never drawn.

  One draw is exactly proportional to the weights; a batch is drawn by Efraimidis-Spirakis
  weighted sampling without replacement: each candidate gets the key log(u) / w (u uniform in
  (0, 1)) and the `want` largest keys win, which is the same as drawing one at a time, each in
  proportion to the weights of those left. Exponential jumps (their A-ExpJ) draw how much weight
  passes before the next key that would enter, instead of a key per candidate. The random source is Lua's math.random, seeded per
  claim from the client's random seed (no two claims share a sequence).

  Cost: every ready sample of the task is examined (a BITPOS-driven scan plus one HMGET per
  window of ids), so a claim costs O(ready samples), not O(batch) as the other samplers.

  Offers:
    select_prioritized(prefix, task, fields, want, alpha, seed)   the ids drawn ({} if too few)
    PRIORITY_SCAN_HINT                                            ids per scan window it asks for
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:cons:<task>  <p>:tag:priority
]]
-- @include chunks
-- @include ready

-- Ids a scan window holds at most (SCAN_MAX_BYTES bytes of bitmap): the scanner's largest read.
local PRIORITY_SCAN_HINT = 8 * SCAN_MAX_BYTES

local function select_prioritized(prefix, task, fields, want, alpha, seed)
  local priorities = {}
  local tag = prefix .. 'tag:priority'
  local on_fill = nil -- no priority set in the partition: every weight is 1, nothing to read
  if redis.call('EXISTS', tag) == 1 then
    on_fill = function(window, from, to)
      local part = {} -- copied, not unpacked: a window may hold more ids than unpack() takes
      for j = from, to do part[j - from + 1] = window[j] end
      local got = hmget_many(tag, part)
      for j = 1, #part do priorities[part[j]] = got[j] end
    end
  end
  local scan = ready_scanner(prefix, task, fields, on_fill)
  math.randomseed(seed)
  -- a min-heap (by key) of the `want` largest keys so far
  local keys, ids, size = {}, {}, 0
  local function sift_down(i)
    while true do
      local l, r, m = 2 * i, 2 * i + 1, i
      if l <= size and keys[l] < keys[m] then m = l end
      if r <= size and keys[r] < keys[m] then m = r end
      if m == i then return end
      keys[i], keys[m] = keys[m], keys[i]
      ids[i], ids[m] = ids[m], ids[i]
      i = m
    end
  end
  local function sift_up(i)
    while i > 1 do
      local parent = math.floor(i / 2)
      if keys[parent] <= keys[i] then return end
      keys[i], keys[parent] = keys[parent], keys[i]
      ids[i], ids[parent] = ids[parent], ids[i]
      i = parent
    end
  end
  local huge = math.huge
  -- Exponential jumps (A-ExpJ): once the heap is full, the weight to skip before the next
  -- candidate that enters is drawn at once, so random numbers and logarithms are spent only on
  -- the O(want * log(ready / want)) candidates that enter, not on every ready sample.
  local threshold, skip = 0, 0 -- the heap's smallest key; weight left to skip
  local function uniform()
    local u = math.random()
    if u <= 0 then u = 1e-300 end
    return u
  end
  local function jump()
    threshold = keys[1]
    if threshold >= 0 then threshold = -1e-300 end
    skip = math.log(uniform()) / threshold
  end
  while true do
    local x = scan.next(PRIORITY_SCAN_HINT)
    if x == nil then break end
    local raw = priorities[x]
    local w = 1
    if raw then
      local p = tonumber(raw)
      if p and p > 0 then
        if alpha ~= 1 then w = p ^ alpha else w = p end
      else
        w = 0
      end
    end
    if w > 0 and w < huge then
      if size < want then
        size = size + 1
        keys[size], ids[size] = math.log(uniform()) / w, x
        sift_up(size)
        if size == want then jump() end
      else
        skip = skip - w
        if skip <= 0 then
          -- this candidate enters: its key is drawn above the threshold, given that it passed it
          local floor = math.exp(threshold * w)
          keys[1], ids[1] = math.log(floor + (1 - floor) * uniform()) / w, x
          sift_down(1)
          jump()
        end
      end
    end
  end
  if size < want then return {} end
  table.sort(ids)
  return ids
end
