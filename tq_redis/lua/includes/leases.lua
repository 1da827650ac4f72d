--[[
  leases: what a claim marks, and the lease bookkeeping of the claim scripts. A claimed sample is
  consumed by the task (its bit in <p>:cons:<task>); with a lease it is also in flight until a
  deadline (<p>:lease:<task>) and counts one more delivery (<p>:dlv:<task>). Lapsed leases are
  handed back by the next claim (no reaper process); samples delivered too often are put aside
  in <p>:poison:<task>. Deadlines are the server's time (includes/clock.lua), never a client's.
  Each lease expiry, redelivery and newly poisoned sample also adds one to the task's counter in
  <p>:counters (fields expired:<task>, redelivered:<task>, poison:<task>): clears, drops and
  resets leave that hash alone, so the counts only ever grow (the exporter's ..._total counters).

  Offers:
    mark_claimed(prefix, task, ids, lease_ms)   consumed (and leased until the server's time +
                                                lease_ms); delivery counts
    poison_ids(prefix, task, ids)               consumed for good, listed as poison
    next_lapse_in(prefix, task)                 ms until the task's earliest lease lapses on the
                                                server's clock (0 if lapsed already), -1 if none
    known_deliveries(prefix, task, ids, lease_ms)  delivery counts of ids with a lease, else {}
    release_lapsed(prefix, task, max_deliveries)   hand leases lapsed on the server's clock back
                                                   (or poison them)
    count_events(prefix, kind, task, n)         add n to the task's <p>:counters field kind:task
  Touches:
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:counters
    and through emit (a `released` event): <p>:events  <p>:waittasks  <p>:waiters:<task>
    <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>  <p>:alive  <p>:prod:<field>
]]
-- @include bits
-- @include chunks
-- @include clock
-- @include events

-- Add n (> 0) events of `kind` ('expired', 'redelivered', 'poison') to the task's counter: one
-- HINCRBY in the script that already runs, never a round trip of its own.
local function count_events(prefix, kind, task, n)
  if n > 0 then redis.call('HINCRBY', prefix .. 'counters', kind .. ':' .. task, n) end
end

-- Mark `ids` consumed by the task; with a lease (lease_ms > 0) also put them in flight until
-- the server's time + lease_ms and count one more delivery each. Returns the delivery counts (or {}).
local function mark_claimed(prefix, task, ids, lease_ms)
  if #ids == 0 then return {} end
  set_id_bits(prefix .. 'cons:' .. task, ids)
  if lease_ms <= 0 then return {} end
  local dlv_key = prefix .. 'dlv:' .. task
  local before = hmget_many(dlv_key, ids)
  local deliveries, zargs, hargs = {}, {}, {}
  local deadline = server_ms() + lease_ms
  local again = 0
  for i = 1, #ids do
    deliveries[i] = (tonumber(before[i]) or 0) + 1
    if deliveries[i] > 1 then again = again + 1 end
    zargs[#zargs + 1] = deadline
    zargs[#zargs + 1] = ids[i]
    hargs[#hargs + 1] = ids[i]
    hargs[#hargs + 1] = deliveries[i]
    if #zargs >= 2 * CHUNK then
      redis.call('ZADD', prefix .. 'lease:' .. task, unpack(zargs))
      redis.call('HSET', dlv_key, unpack(hargs))
      zargs, hargs = {}, {}
    end
  end
  if #zargs > 0 then
    redis.call('ZADD', prefix .. 'lease:' .. task, unpack(zargs))
    redis.call('HSET', dlv_key, unpack(hargs))
  end
  count_events(prefix, 'redelivered', task, again)
  return deliveries
end

-- Put samples aside for a task for good: consumed, and listed in its poison set (`status`
-- shows them). Used for samples past max_deliveries and for stale samples dropped on request.
local function poison_ids(prefix, task, ids)
  if #ids == 0 then return end
  set_id_bits(prefix .. 'cons:' .. task, ids)
  local added = 0
  for from = 1, #ids, CHUNK do
    added = added + redis.call('SADD', prefix .. 'poison:' .. task, unpack(ids, from, math.min(#ids, from + CHUNK - 1)))
  end
  count_events(prefix, 'poison', task, added)
end

-- Milliseconds until the task's earliest lease lapses on the server's clock (0 when it has
-- lapsed already), -1 if none is in flight. Relative, so a client waits for it on no clock of its own.
local function next_lapse_in(prefix, task)
  local first = redis.call('ZRANGE', prefix .. 'lease:' .. task, 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return math.max(0, tonumber(first[2]) - server_ms())
end

-- Delivery counts of `ids` (0 where never delivered) when claimed with a lease (lease_ms > 0),
-- else {}: what a claim reports for ids it hands back from a stored choice.
local function known_deliveries(prefix, task, ids, lease_ms)
  if lease_ms <= 0 or #ids == 0 then return {} end
  local got = hmget_many(prefix .. 'dlv:' .. task, ids)
  local out = {}
  for i = 1, #ids do out[i] = tonumber(got[i]) or 0 end
  return out
end

-- Give leases of a task that lapsed on the server's clock back: clear their consumed bits so
-- the next claim sees them, or move them to the poison set once they reached max_deliveries
-- (0 = unlimited). Returns how many were released, and whether the task has leases in flight at
-- all (when it has none, the common fetch case, this costs one ZRANGE and no clock reading, and
-- callers need not look again).
local function release_lapsed(prefix, task, max_deliveries)
  local lease = prefix .. 'lease:' .. task
  local first = redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')
  if #first == 0 then return 0, false end
  local now_ms = server_ms()
  if tonumber(first[2]) > now_ms then return 0, true end
  local lapsed = redis.call('ZRANGEBYSCORE', lease, '-inf', now_ms)
  if #lapsed == 0 then return 0, true end
  for from = 1, #lapsed, CHUNK do
    redis.call('ZREM', lease, unpack(lapsed, from, math.min(#lapsed, from + CHUNK - 1)))
  end
  count_events(prefix, 'expired', task, #lapsed)
  local release, poison = {}, {}
  if max_deliveries > 0 then
    local counts = hmget_many(prefix .. 'dlv:' .. task, lapsed)
    for i = 1, #lapsed do
      if tonumber(counts[i] or 0) >= max_deliveries then
        poison[#poison + 1] = tonumber(lapsed[i])
      else
        release[#release + 1] = tonumber(lapsed[i])
      end
    end
  else
    for i = 1, #lapsed do release[i] = tonumber(lapsed[i]) end
  end
  if #poison > 0 then poison_ids(prefix, task, poison) end
  if #release > 0 then
    set_bits(prefix .. 'cons:' .. task, release, 0)
    emit(prefix, 'released', 'task', task, 'count', #release)
  end
  return #release, true
end
