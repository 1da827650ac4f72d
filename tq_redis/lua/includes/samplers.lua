--[[
  samplers: the built-in samplers, run inside the claim script on the stream of ready ids (ready.lua).

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

  Offers:
    select_units(prefix, task, fields, want, opts)   the selection above; returns ids, tags, aside
    parse_alive_ids(prefix, text)                    ids of a cached choice, nil if one is gone
    TOKEN_LOOKAHEAD                                  units in a row that may miss the budget
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:cons:<task>              (the ready stream, parse_alive_ids)
    <p>:tagnames  <p>:tag:<name>  <p>:dlv:<task>              (what examine reads)
    <p>:groups  <p>:groupidx                                  (GRPO units by insert)
    <p>:poison:<task>  <p>:counters                           (samples put aside, counted)
]]
-- @include alive
-- @include chunks
-- @include groups
-- @include leases
-- @include ready

local TOKEN_LOOKAHEAD = 64

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
  local need_len = max_tokens > 0 or opts.weights

  -- Fast path (the default sampler): no filter, no groups, no budget -- bulk copy of the stream,
  -- before any of the tables the other samplers need is built (each costs the claim time).
  if n == 1 and not need_len and not min_version and max_deliveries <= 0 then
    local out = {}
    if take_ready(prefix, task, fields, want, out) < want then out = {} end
    return out, {len = {}}, {}
  end

  local by_uid = n > 1 and redis.call('SISMEMBER', prefix .. 'tagnames', 'uid') == 1
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
