--[[
  waiters: consumers waiting in get_meta for a task's samples, and the wake tokens that wake them
  one at a time (no thundering herd): an event wakes one waiter per task, and the woken one passes
  the baton on. Every key here expires on its own, so a consumer that died leaves nothing for good.

  Offers:
    server_ms()                               server time in ms
    WAIT_KEY_TTL_MS, keep_alive(key, ms)      expiry of the waiting keys
    wake_one(prefix, task, now_ms)            push a wake token for one waiter of the task
    register_waiter(prefix, task, waiter, timeout_ms)
    wake_waiters(prefix)                      something changed: wake one waiter per task
    pass_baton(prefix, task, any_left)        after a claim that handed samples out
    pass_unused(prefix, task, any_ready)      after a claim that found too few samples
  Touches:
    <p>:waittasks  <p>:waiters:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
]]

-- Server time in ms (functions replicate their effects, so reading the clock is allowed).
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Waiting consumers of `task` (ZSET waiter -> deadline ms) and the tokens that wake them (LIST,
-- one BLPOP each). Both expire on their own, so a consumer that died leaves nothing for good.
local WAIT_KEY_TTL_MS = 60000

local function keep_alive(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end

-- Wake one waiting consumer of `task`, unless there are already as many tokens as waiters.
-- Returns how many consumers wait.
local function wake_one(prefix, task, now_ms)
  local waiters = prefix .. 'waiters:' .. task
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
  local n = redis.call('ZCARD', waiters)
  if n == 0 then
    redis.call('SREM', prefix .. 'waittasks', task)
    return 0
  end
  local wake = prefix .. 'wake:' .. task
  if redis.call('LLEN', wake) < n then
    redis.call('RPUSH', wake, '1')
    keep_alive(wake, WAIT_KEY_TTL_MS)
  end
  return n
end

-- Record `waiter` as waiting for `task` for up to `timeout_ms`.
local function register_waiter(prefix, task, waiter, timeout_ms)
  local waiters = prefix .. 'waiters:' .. task
  redis.call('ZADD', waiters, server_ms() + timeout_ms, waiter)
  redis.call('SADD', prefix .. 'waittasks', task)
  keep_alive(waiters, timeout_ms + WAIT_KEY_TTL_MS)
  keep_alive(prefix .. 'waittasks', timeout_ms + WAIT_KEY_TTL_MS)
end

-- Something changed: wake one waiting consumer per task, instead of every consumer racing for
-- one sample. The woken one passes the baton on (see claim): after taking samples, and after
-- finding samples it cannot use (a smaller batch may fit another waiter), the latter at most once
-- per waiter per event (`wakebudget`), so waiters that cannot be served never wake each other
-- in a loop.
local function wake_waiters(prefix)
  local tasks = redis.call('SMEMBERS', prefix .. 'waittasks')
  if #tasks == 0 then return end
  local now_ms = server_ms()
  for i = 1, #tasks do
    local n = wake_one(prefix, tasks[i], now_ms)
    if n > 0 then redis.call('SET', prefix .. 'wakebudget:' .. tasks[i], n, 'PX', WAIT_KEY_TTL_MS) end
  end
end

-- After a claim that handed samples out: wake one more waiter of the task, if it has any and
-- `any_left()` says the task has samples left that a waiter might take. When the claim took the
-- last of them, the next event wakes a waiter instead; a baton now would only make one claim in
-- vain and wait again (per sample, in a stream of single-sample puts).
local function pass_baton(prefix, task, any_left)
  if redis.call('SISMEMBER', prefix .. 'waittasks', task) == 1 and any_left() then
    wake_one(prefix, task, server_ms())
  end
end

-- After a claim that found too few samples: if some are ready, let another waiter try them.
local function pass_unused(prefix, task, any_ready)
  local budget = prefix .. 'wakebudget:' .. task
  if tonumber(redis.call('GET', budget) or '0') <= 0 or not any_ready() then return end
  redis.call('DECR', budget)
  wake_one(prefix, task, server_ms())
end
