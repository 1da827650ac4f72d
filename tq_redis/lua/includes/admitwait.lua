--[[
  admitwait: producers waiting to be admitted. A reservation refused by the staleness bound
  (group_reserve) and an insert refused by a rate limiter (includes/ratelimit.lua) register here
  and BLPOP <p>:admitwake; whatever may have made room (a version bump, a freed reservation, a
  consumer's claim under a rate limiter) wakes every one of them, and each asks again. Both keys
  expire on their own, so a producer that died leaves nothing for good.

  Offers:
    ADMIT_KEY_TTL_MS                          how long the keys outlive their last waiter
    admit_wake(prefix, now)                   wake every waiting producer (room may have appeared)
    admit_wait(prefix, waiter, now, wait_ms)  register a refused producer until now + wait_ms
  Touches:
    <p>:admitwaiters  <p>:admitwake
]]

local ADMIT_KEY_TTL_MS = 60000

local function admit_wake(prefix, now)
  local waiters = prefix .. 'admitwaiters'
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now)
  local n = redis.call('ZCARD', waiters)
  if n == 0 then return end
  local wake = prefix .. 'admitwake'
  redis.call('DEL', wake)
  local tokens = {}
  for i = 1, n do tokens[i] = '1' end
  redis.call('RPUSH', wake, unpack(tokens))
  redis.call('PEXPIRE', wake, ADMIT_KEY_TTL_MS)
end

local function admit_wait(prefix, waiter, now, wait_ms)
  local waiters = prefix .. 'admitwaiters'
  redis.call('ZADD', waiters, now + wait_ms, waiter)
  local keep = wait_ms + ADMIT_KEY_TTL_MS
  if redis.call('PTTL', waiters) < keep then redis.call('PEXPIRE', waiters, keep) end
end
