--[[
  waiters: consumers waiting in get_meta for a task's samples, and the wake tokens that wake them
  one at a time (no thundering herd): an event wakes one waiter per task, and the woken one passes
  the baton on. Every key here expires on its own, so a consumer that died leaves nothing for good.

  A waiter may say what it needs (`need_of`: a batch size and the fields): then new data wakes it
  only once that many samples are ready for the task, so a trainer waiting for a large batch is
  not woken by every small put (each wake costs it a round trip and a claim that finds too
  little). The need is the task's, not the waiter's: while waiters of a task ask for different
  things, or one cannot say (a user sampler, a token budget, a rank's stored choice), it is '*'
  and every event wakes one of them, as it always did; so does new data while the task has
  leases in flight (a claim hands lapsed ones back, and no event says they lapsed).

  Offers:
    WAIT_KEY_TTL_MS, keep_alive(key, ms)      expiry of the waiting keys
    need_of(want, fields)                     a need for register_waiter
    need_met(prefix, task)                    whether the task's known need (if any) is met
    wake_one(prefix, task, now_ms, check)     push a wake token for one waiter of the task (with
                                              `check`, only if the task's need is met)
    register_waiter(prefix, task, waiter, timeout_ms, need)
    wake_waiters(prefix, check)               something changed: wake one waiter per task
    pass_baton(prefix, task)                  after a claim that handed samples out
    pass_unused(prefix, task, fields)         after a claim that found too few samples
  Touches:
    <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    and, to check a need, <p>:lease:<task> and what ready_scanner reads: <p>:alive  <p>:prod:<field>
    <p>:cons:<task>
]]
-- @include clock
-- @include ready

-- Waiting consumers of `task` (ZSET waiter -> deadline ms) and the tokens that wake them (LIST,
-- one BLPOP each). Both expire on their own, so a consumer that died leaves nothing for good.
local WAIT_KEY_TTL_MS = 60000

local function keep_alive(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end

-- A waiter's need: `want` samples ready with every one of `fields` (tab-separated; a field name
-- holds no tab). nil for a need that is not known.
local function need_of(want, fields)
  return want .. '\t' .. table.concat(fields, '\t')
end

-- Whether the task's waiters may be able to claim: true unless their common need is known and
-- fewer than its `want` samples are ready (a scan of at most `want` ready ids, the work the
-- woken claim would do). While the task has leases in flight, a claim may also hand back lapsed
-- ones, which no event announces and the scan cannot see: then it is always true.
local function need_met(prefix, task)
  local need = redis.call('GET', prefix .. 'waitneed:' .. task)
  if not need or need == '*' then return true end
  if redis.call('ZCARD', prefix .. 'lease:' .. task) > 0 then return true end
  local parts = {}
  for part in string.gmatch(need, '[^\t]+') do parts[#parts + 1] = part end
  local want = tonumber(parts[1])
  local fields = {unpack(parts, 2)}
  return take_ready(prefix, task, fields, want, {}) >= want
end

-- Wake one waiting consumer of `task`, unless there are already as many tokens as waiters, or
-- (with `check`) the waiters' known need is not met yet. Returns how many consumers wait.
local function wake_one(prefix, task, now_ms, check)
  local waiters = prefix .. 'waiters:' .. task
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
  local n = redis.call('ZCARD', waiters)
  if n == 0 then
    redis.call('SREM', prefix .. 'waittasks', task)
    return 0
  end
  if check and not need_met(prefix, task) then return n end
  local wake = prefix .. 'wake:' .. task
  if redis.call('LLEN', wake) < n then
    redis.call('RPUSH', wake, '1')
    keep_alive(wake, WAIT_KEY_TTL_MS)
  end
  return n
end

-- Record `waiter` as waiting for `task` for up to `timeout_ms`, needing `need` (see need_of;
-- nil: not known). The task's need stays known only while every waiter states the same one.
local function register_waiter(prefix, task, waiter, timeout_ms, need)
  local waiters = prefix .. 'waiters:' .. task
  local need_key = prefix .. 'waitneed:' .. task
  need = need or '*'
  if need ~= '*' and redis.call('ZCARD', waiters) > 0 and redis.call('GET', need_key) ~= need then
    need = '*'
  end
  redis.call('SET', need_key, need, 'PX', timeout_ms + WAIT_KEY_TTL_MS)
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
local function wake_waiters(prefix, check)
  local tasks = redis.call('SMEMBERS', prefix .. 'waittasks')
  if #tasks == 0 then return end
  local now_ms = server_ms()
  for i = 1, #tasks do
    local n = wake_one(prefix, tasks[i], now_ms, check)
    if n > 0 then redis.call('SET', prefix .. 'wakebudget:' .. tasks[i], n, 'PX', WAIT_KEY_TTL_MS) end
  end
end

-- After a claim that handed samples out: wake one more waiter of the task, if it has any and the
-- task has samples left that a waiter might take (any_unconsumed). When the claim took the last
-- of them, the next event wakes a waiter instead; a baton now would only make one claim in vain
-- and wait again (per sample, in a stream of single-sample puts).
local function pass_baton(prefix, task)
  if redis.call('SISMEMBER', prefix .. 'waittasks', task) == 1 and any_unconsumed(prefix, task) then
    wake_one(prefix, task, server_ms(), true)
  end
end

-- After a claim that found too few samples: if some are ready with `fields`, let another waiter
-- try them.
local function pass_unused(prefix, task, fields)
  local budget = prefix .. 'wakebudget:' .. task
  if tonumber(redis.call('GET', budget) or '0') <= 0 or take_ready(prefix, task, fields, 1, {}) == 0 then return end
  redis.call('DECR', budget)
  wake_one(prefix, task, server_ms(), true)
end
