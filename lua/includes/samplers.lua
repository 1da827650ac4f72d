--[[
  The built-in samplers, run inside the claim script on the stream of ready ids (ready.lua).

  Every built-in is one selection over that stream, in ascending id order:
    examine    each ready id pulled from the stream is examined once: it is eligible unless
               it is past max_deliveries (poisoned), older than min_policy_version (dropped too
               when drop_stale), or lacks a tag the options need (total_lengths for max_tokens,
               policy_version for min_policy_version, uid when grouping by uid)
    units      n = 1: each eligible id is a unit. n > 1 (GRPO): a unit is a whole group of n:
               the rows sharing a `uid` tag when the partition has that tag, else n rows aligned
               to the start of the insert that put them (the `groups` HASH) -- never a run of
               ready ids that straddles two prompts. A group is a unit only if all n are ready
               and eligible.
    budget     without max_tokens: units are taken until `want` samples; fewer ready means
               nothing is taken. With max_tokens: first fit in id order -- a unit is taken if
               it keeps the summed total_lengths within the budget; the scan stops at `want`
               samples, at the end of the stream, or after LOOKAHEAD units in a row that did
               not fit once something was taken. The batch may then be smaller than `want`.
  RankAware and SeqlenBalanced wrap this selection with a per-(task, dp_rank, batch_index)
  cache of the first caller's choice, kept under a key of the partition's slot.
  tests/unit/test_samplers.py holds a pure-Python model of exactly these rules.
]]

local TOKEN_LOOKAHEAD = 64

-- The inserts of a partition by first id, mirrored from the `groups` HASH (first id -> count)
-- into the ZSET `<prefix>groupidx`, so the insert holding an id is one ZREVRANGEBYSCORE away.
-- Synced lazily by walking forward from the newest known insert; rebuilt from the HASH when
-- the walk cannot account for every insert (out-of-order or failed inserts, a dropped and
-- re-created partition). The TTL lets the mirror of a dropped partition go away by itself.
local GROUPIDX_TTL_MS = 86400000

local function rebuild_group_index(prefix)
  local idx = prefix .. 'groupidx'
  redis.call('DEL', idx)
  local firsts = redis.call('HKEYS', prefix .. 'groups')
  local zargs = {}
  for i = 1, #firsts do
    zargs[#zargs + 1] = firsts[i]
    zargs[#zargs + 1] = firsts[i]
    if #zargs >= 2 * BITFIELD_CHUNK then
      redis.call('ZADD', idx, unpack(zargs))
      zargs = {}
    end
  end
  if #zargs > 0 then redis.call('ZADD', idx, unpack(zargs)) end
  redis.call('PEXPIRE', idx, GROUPIDX_TTL_MS)
end

local function sync_group_index(prefix)
  local groups, idx = prefix .. 'groups', prefix .. 'groupidx'
  local hlen, zcard = redis.call('HLEN', groups), redis.call('ZCARD', idx)
  if hlen == zcard then return end
  if zcard == 0 or zcard > hlen then return rebuild_group_index(prefix) end
  local last = tonumber(redis.call('ZREVRANGE', idx, 0, 0)[1])
  local count = tonumber(redis.call('HGET', groups, last))
  if not count then return rebuild_group_index(prefix) end
  local nxt = last + count
  while zcard < hlen do
    count = tonumber(redis.call('HGET', groups, nxt))
    if not count then return rebuild_group_index(prefix) end
    redis.call('ZADD', idx, nxt, nxt)
    zcard = zcard + 1
    nxt = nxt + count
  end
  redis.call('PEXPIRE', idx, GROUPIDX_TTL_MS)
end

-- A lookup of the insert {first, count} holding an id (nil if none), caching the last hit.
local function insert_finder(prefix)
  sync_group_index(prefix)
  local first, count = -1, 0
  local rebuilt = false
  local function find(x)
    if x >= first and x < first + count then return first, count end
    for _ = 1, 2 do
      local got = redis.call('ZREVRANGEBYSCORE', prefix .. 'groupidx', x, '-inf', 'LIMIT', 0, 1)
      if #got > 0 then
        local f = tonumber(got[1])
        local c = tonumber(redis.call('HGET', prefix .. 'groups', f))
        if c and x < f + c then
          first, count = f, c
          return f, c
        end
      end
      if rebuilt then return nil end
      rebuild_group_index(prefix) -- the mirror is stale; rebuild once per claim
      rebuilt = true
    end
    return nil
  end
  return find
end

--[[
  Select units from the ready stream. opts:
    n               group size (1 = single samples)
    max_tokens      token budget by total_lengths (0 = none)
    min_version     only samples with policy_version >= it (nil = no bound)
    drop_stale      put samples below min_version aside for the task (poison set)
    max_deliveries  lease mode: samples delivered this often go to the poison set (0 = none)
    weights         also fetch total_lengths (for balancing) even without max_tokens
  Returns ids (units adjacent, each group in id order), the tables of fetched tags by id, and
  the ids put aside (already applied).
]]
local function select_units(prefix, task, fields, want, opts)
  local n = opts.n or 1
  local max_tokens = opts.max_tokens or 0
  local min_version = opts.min_version
  local max_deliveries = opts.max_deliveries or 0
  local by_uid = n > 1 and redis.call('SISMEMBER', prefix .. 'tagnames', 'uid') == 1
  local need_len = max_tokens > 0 or opts.weights
  local tags = {len = {}, ver = {}, uid = {}, dlv = {}}
  local fetch = {}
  if need_len then fetch[#fetch + 1] = {prefix .. 'tag:total_lengths', tags.len} end
  if min_version then fetch[#fetch + 1] = {prefix .. 'tag:policy_version', tags.ver} end
  if by_uid then fetch[#fetch + 1] = {prefix .. 'tag:uid', tags.uid} end
  if max_deliveries > 0 then fetch[#fetch + 1] = {prefix .. 'dlv:' .. task, tags.dlv} end

  local on_fill = nil
  if #fetch > 0 then
    on_fill = function(ids, from, to)
      local window = {unpack(ids, from, to)}
      for i = 1, #fetch do
        local got = hmget_many(fetch[i][1], window)
        local into = fetch[i][2]
        for j = 1, #window do into[window[j]] = got[j] end
      end
    end
  end
  local scan = ready_scanner(prefix, task, fields, on_fill)

  local verdict, aside = {}, {}
  local function examine(x)
    local v = verdict[x]
    if v ~= nil then return v end
    v = true
    if max_deliveries > 0 and (tonumber(tags.dlv[x]) or 0) >= max_deliveries then
      aside[#aside + 1] = x
      v = false
    end
    if v and min_version then
      local ver = tonumber(tags.ver[x])
      if ver == nil then
        v = false
      elseif ver < min_version then
        if opts.drop_stale then aside[#aside + 1] = x end
        v = false
      end
    end
    if v and max_tokens > 0 and tonumber(tags.len[x]) == nil then v = false end
    if v and by_uid and not tags.uid[x] then v = false end
    verdict[x] = v
    return v
  end

  -- Fast path (the default sampler): no filter, no groups, no budget -- bulk copy of the stream.
  if n == 1 and #fetch == 0 then
    local out = {}
    local count = scan.take(want, out, 0)
    if count < want then out = {} end
    return out, tags, aside
  end

  local next_unit
  if n == 1 then
    next_unit = function(need)
      while true do
        local x = scan.next(need)
        if x == nil then return nil end
        if examine(x) then return {x} end
      end
    end
  elseif by_uid then
    local buckets = {}
    next_unit = function(need)
      while true do
        local x = scan.next(need)
        if x == nil then return nil end
        if examine(x) then
          local u = tags.uid[x]
          local bucket = buckets[u]
          if bucket == nil then
            bucket = {}
            buckets[u] = bucket
          end
          bucket[#bucket + 1] = x
          if #bucket == n then
            buckets[u] = nil
            return bucket
          end
        end
      end
    end
  else
    local find = insert_finder(prefix)
    next_unit = function(need)
      while true do
        local x = scan.next(need)
        if x == nil then return nil end
        local ok = examine(x)
        local f, c = find(x)
        if f then
          local g = f + math.floor((x - f) / n) * n
          if x == g and g + n <= f + c then
            local members = {x}
            for j = 1, n - 1 do
              local y = scan.next(need)
              if y == nil then return nil end
              if y ~= g + j then
                scan.unread()
                break
              end
              members[#members + 1] = y
              ok = examine(y) and ok
            end
            if #members == n and ok then return members end
          end
        end
      end
    end
  end

  local out, count, tokens, misses = {}, 0, 0, 0
  while count < want do
    local unit = next_unit(want - count)
    if unit == nil then break end
    local take = true
    if max_tokens > 0 then
      local w = 0
      for i = 1, #unit do w = w + tonumber(tags.len[unit[i]]) end
      if tokens + w <= max_tokens then
        tokens = tokens + w
      else
        take = false
        misses = misses + 1
        if count > 0 and misses >= TOKEN_LOOKAHEAD then break end
      end
    end
    if take then
      misses = 0
      for i = 1, #unit do out[#out + 1] = unit[i] end
      count = count + #unit
    end
  end
  poison_ids(prefix, task, aside)
  if max_tokens == 0 and count < want then out = {} end
  return out, tags, aside
end

-- Ids of a cached choice ("1,2,3"), or nil if any of them is gone (cleared / partition dropped).
local function parse_alive_ids(prefix, text)
  local ids = {}
  for s in string.gmatch(text, '%d+') do ids[#ids + 1] = tonumber(s) end
  if #ids == 0 then return ids end
  if #missing_ids(prefix, ids) > 0 then return nil end
  return ids
end

--[[
  Karmarkar-Karp largest differencing into k parts with an equal number of items each
  (#weights must be a multiple of k), as the reference SeqlenBalancedSampler does at the group
  level. Ties are broken by a total order, so the result is deterministic:
    a set is ordered by (sum, item count, smallest item); a state's sets are kept largest first
    states are merged largest spread first, then largest first set, then smallest first item.
  Returns k lists of item indexes (1-based, ascending), heaviest part first.
]]
local function set_less(a, b)
  if a.sum ~= b.sum then return a.sum < b.sum end
  if #a.items ~= #b.items then return #a.items < #b.items end
  return a.low < b.low
end

local function state_first(a, b) -- true if state a is merged before state b
  if a.spread ~= b.spread then return a.spread > b.spread end
  local sa, sb = a.sets[1], b.sets[1]
  if set_less(sa, sb) or set_less(sb, sa) then return set_less(sb, sa) end
  return a.low < b.low
end

local function state_settle(st)
  table.sort(st.sets, function(x, y) return set_less(y, x) end)
  st.spread = st.sets[1].sum - st.sets[#st.sets].sum
  local low = st.sets[1].low
  for i = 2, #st.sets do
    if st.sets[i].low < low then low = st.sets[i].low end
  end
  st.low = low
end

local function kk_partition(weights, k)
  local order = {}
  for i = 1, #weights do order[i] = i end
  table.sort(order, function(a, b)
    if weights[a] ~= weights[b] then return weights[a] < weights[b] end
    return a < b
  end)
  local heap = {}
  local function push(st)
    heap[#heap + 1] = st
    local i = #heap
    while i > 1 do
      local p = math.floor(i / 2)
      if state_first(heap[i], heap[p]) then
        heap[i], heap[p] = heap[p], heap[i]
        i = p
      else
        break
      end
    end
  end
  local function pop()
    local top = heap[1]
    heap[1] = heap[#heap]
    heap[#heap] = nil
    local i = 1
    while true do
      local l, r, best = 2 * i, 2 * i + 1, i
      if l <= #heap and state_first(heap[l], heap[best]) then best = l end
      if r <= #heap and state_first(heap[r], heap[best]) then best = r end
      if best == i then break end
      heap[i], heap[best] = heap[best], heap[i]
      i = best
    end
    return top
  end
  for from = 1, #order, k do
    local st = {sets = {}}
    for j = 0, k - 1 do
      local item = order[from + j]
      st.sets[j + 1] = {sum = weights[item], items = {item}, low = item}
    end
    state_settle(st)
    push(st)
  end
  while #heap > 1 do
    local a, b = pop(), pop()
    for i = 1, k do
      local s, t = a.sets[i], b.sets[k + 1 - i]
      for j = 1, #t.items do s.items[#s.items + 1] = t.items[j] end
      s.sum = s.sum + t.sum
      if t.low < s.low then s.low = t.low end
    end
    state_settle(a)
    push(a)
  end
  local parts = {}
  for i = 1, k do
    local items = heap[1].sets[i].items
    table.sort(items)
    parts[i] = items
  end
  return parts
end
