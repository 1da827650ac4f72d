--[[
  claiming: the steps of the claim script around its selection, as plain functions of the
  partition prefix and one table of the claim's inputs (`c`), not closures made afresh by every
  claim: each closure, and each local it captures, is an allocation in a call that should cost
  its redis.calls and little else.

  c holds the claim's inputs, as claim.lua parses them:
    task want lease_ms max_deliveries sampler opts fields waiter wait_ms
    leased   whether the task had leases in flight when the claim began

  Offers:
    claim_lapse(prefix, c)                     ms until the earliest lease lapses, to report; -1 if none
    claim_nothing(prefix, c, schemas, next_lapse)  the reply without ids (registers the waiter)
    claim_none_ready(prefix, c)                no batch: the reply, after asking whether the
                                               partition exists
    claim_reply(prefix, c, ids, deliveries)    the reply of a claim that marked `ids`
    cached_choice(prefix, c, cache_key, part)  the reply from a rank's stored choice, or nil
    claim_balanced(prefix, c, ids, tags, n, dp_size, part, cache_key, ttl)
                                               split a balanced choice, store it, reply with part
    rate_held(prefix, c, b)                    whether the task's rate limiter holds a claim of b
                                               samples back (sets c.limited: nil when it has none)
    rate_count(prefix, c, ids)                 count a claim's ids against that limiter
  Touches:
    <p>:meta  <p>:tasks  <p>:fields  <p>:inline  <p>:shared  <p>:tagnames  <p>:tag:<name>  <p>:alive
    <p>:prod:<field>  <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>
    <p>:wakebudget:<task>   (and the rank or balance cache key the caller names)
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
]]
-- @include balance
-- @include clock
-- @include events
-- @include inline
-- @include leases
-- @include ratelimit
-- @include samplers
-- @include schemas
-- @include tags
-- @include waiters

-- When the earliest lease lapses, to report: none when no lease was in flight before and none is
-- taken now.
local function claim_lapse(prefix, c)
  if c.leased or c.lease_ms > 0 then return next_lapse_in(prefix, c.task) end
  return -1
end

-- Nothing to hand out: with a waiter id and wait_ms > 0 the caller now waits for a wake token
-- (registered in this same atomic step, so no event can slip in between); else it stops waiting.
local function claim_nothing(prefix, c, schemas, next_lapse)
  local registered = 0
  if c.waiter and c.wait_ms > 0 then
    -- What this claim needs to succeed, for the waiters' wake-ups (see includes/waiters.lua):
    -- known only where it never hands out fewer than `want` ready samples -- not with a token
    -- budget, or a rank's or a balanced choice an earlier rank stored. (Lapsed leases handed
    -- back are need_met's business: leases may be taken after this waiter registered.)
    local need = nil
    if (c.sampler == 'sequential' or c.sampler == 'grpo' or c.sampler == 'priority') and tonumber(c.opts.max_tokens or '0') <= 0 then
      need = need_of(c.want, c.fields)
    end
    register_waiter(prefix, c.task, c.waiter, c.wait_ms, need)
    registered = 1
    pass_unused(prefix, c.task, c.fields)
  elseif c.waiter then
    redis.call('ZREM', prefix .. 'waiters:' .. c.task, c.waiter)
  end
  return {last_event_id(prefix), {}, schemas, {}, {}, next_lapse, registered}
end

-- No batch: a partition that does not exist has no lease, no cached choice and no alive id, so
-- nothing before this wrote a key of it; its existence is asked only now.
local function claim_none_ready(prefix, c)
  if redis.call('EXISTS', prefix .. 'meta') == 0 then return claim_nothing(prefix, c, {}, -1) end
  redis.call('SADD', prefix .. 'tasks', c.task)
  return claim_nothing(prefix, c, read_schemas(prefix, c.fields), claim_lapse(prefix, c))
end

-- The reply of a claim that handed out `ids` (already marked), or of one that found none.
local function claim_reply(prefix, c, ids, deliveries)
  if #ids == 0 then return claim_none_ready(prefix, c) end
  local task = c.task
  redis.call('SADD', prefix .. 'tasks', task)
  if c.waiter then redis.call('ZREM', prefix .. 'waiters:' .. task, c.waiter) end
  pass_baton(prefix, task) -- more for the other waiters?
  -- '' for the event id: a caller that got ids never waits, so the stream is not read.
  local inline = redis.call('EXISTS', prefix .. 'inline')
  -- group-shared fields (includes/shares.lua) are resolved by read_inline: send get_data there,
  -- and return false for the values (the caller reads the batch with get_data then)
  local shared = redis.call('EXISTS', prefix .. 'shared') == 1
  if shared then inline = 1 end
  local out = {'', ids, read_schemas(prefix, c.fields), read_tags(prefix, ids), deliveries, claim_lapse(prefix, c), 0, inline}
  if c.opts._values == '1' then
    if shared then out[9] = false else out[9] = inline_get(prefix, ids, c.fields, inline == 1) end
  end
  return out
end

-- rank / balance: the choice an earlier rank stored, handed back as it is (nil when there is
-- none, or when a sample of it is gone: then it is dropped and chosen afresh).
local function cached_choice(prefix, c, cache_key, part)
  local cached = redis.call('GET', cache_key)
  if not cached then return nil end
  local parts = {}
  for s in string.gmatch(cached, '[^;]+') do parts[#parts + 1] = s end
  local ids = parse_alive_ids(prefix, parts[part] or '')
  if ids then return claim_reply(prefix, c, ids, known_deliveries(prefix, c.task, ids, c.lease_ms)) end
  redis.call('DEL', cache_key)
  return nil
end

-- balance: split the selected whole groups into dp_size parts balanced by total_lengths, store
-- every part for the other ranks and hand this rank its own.
local function claim_balanced(prefix, c, ids, tags, n, dp_size, part, cache_key, ttl)
  local weights = {}
  for g = 1, #ids / n do
    local w = 0
    for j = 1, n do w = w + (tonumber(tags.len[ids[(g - 1) * n + j]]) or 1) end
    weights[g] = w
  end
  local groups = kk_partition(weights, dp_size)
  local texts, mine = {}, {}
  for r = 1, dp_size do
    local members = {}
    for _, g in ipairs(groups[r]) do
      for j = 1, n do members[#members + 1] = ids[(g - 1) * n + j] end
    end
    texts[r] = table.concat(members, ',')
    if r == part then mine = members end
  end
  redis.call('SET', cache_key, table.concat(texts, ';'), 'PX', ttl)
  return claim_reply(prefix, c, mine, known_deliveries(prefix, c.task, mine, c.lease_ms))
end

-- Under a rate limiter of the task (includes/ratelimit.lua): whether a claim of b samples must
-- wait (it then finds nothing, and the next insert wakes it); c.limited says there is one.
local function rate_held(prefix, c, b)
  c.limited = rl_may_sample(prefix, c.task, b)
  return c.limited == false
end

local function rate_count(prefix, c, ids)
  if c.limited ~= nil then rl_count_sampled(prefix, c.task, #ids, server_ms()) end
end
