--[[
  ratelimit: a samples-per-insert rate limiter per task (after Reverb's SampleToInsertRatio).
  With samples_per_insert r, min_size_to_sample m and error_buffer e, the difference
  d = inserts * r - samples (samples: ids handed to the task, a replayed sample counted each
  time) is kept within [r*m - e, r*m + e]:
    - an insert of n samples is admitted while its first one keeps d <= r*m + e (a batch may
      overshoot by (n - 1) * r); otherwise the producer waits (includes/admitwait.lua) until a
      claim of the task wakes it;
    - a claim of b samples is admitted once inserts >= m and it keeps d >= r*m - e, or while
      producers are held back (d + r > r*m + e: waiting for them could never end); otherwise
      it finds nothing, and the next insert wakes the task's waiting consumers as always.
  Inserts are counted when the ids are allocated (reserve, an inline insert, kv_put's new keys,
  group_reserve); a group reservation freed without its commit takes its count back. Counting
  starts when a task's first limiter is set (rate_limit_config), from the samples alive then
  and those the task consumed; the hash goes when its last limiter is removed. Clearing or
  dropping samples takes nothing back: the counts only grow, as Reverb's do.

  <p>:ratelimit  HASH  inserts -> n; cfg:<task> -> "r \t m \t e \t insert timeout ms ('' = none)";
                       sampled:<task> -> n

  Offers:
    rl_parse(cfg)                             a cfg:<task> value: r, m, e, timeout_ms text
    rl_refusal(prefix, n)                     nil when an insert of n is admitted (and counted);
                                              else {task, inserts, samples, timeout_ms}
    insert_held(prefix, n, waiter, wait_ms)   rl_refusal for a script's reply: nil, or
                                              {-6, task, inserts, samples, timeout_ms} after
                                              registering the waiter ('' = none) for wait_ms
    rl_uncount_inserts(prefix, n)             a reservation of n freed without its commit
    rl_may_sample(prefix, task, b)            nil: the task has no limiter; else whether a claim
                                              of b samples is admitted now
    rl_count_sampled(prefix, task, n, now)    count n samples handed out; wake waiting producers
  Touches:
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
]]
-- @include admitwait
-- @include clock

local function rl_parse(cfg)
  local parts = {}
  for part in string.gmatch(cfg .. '\t', '([^\t]*)\t') do parts[#parts + 1] = part end
  return tonumber(parts[1]), tonumber(parts[2]), tonumber(parts[3]), parts[4]
end

local function rl_refusal(prefix, n)
  local key = prefix .. 'ratelimit'
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local h = {}
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
  local inserts = tonumber(h.inserts) or 0
  for field, cfg in pairs(h) do
    if string.sub(field, 1, 4) == 'cfg:' then
      local task = string.sub(field, 5)
      local r, m, e, timeout = rl_parse(cfg)
      local samples = tonumber(h['sampled:' .. task]) or 0
      if (inserts + 1) * r - samples > r * m + e then return {task, inserts, samples, timeout} end
    end
  end
  redis.call('HINCRBY', key, 'inserts', n)
  return nil
end

local function insert_held(prefix, n, waiter, wait_ms)
  local refused = rl_refusal(prefix, n)
  if not refused then
    if waiter ~= '' then redis.call('ZREM', prefix .. 'admitwaiters', waiter) end
    return nil
  end
  wait_ms = tonumber(wait_ms) or 0
  if waiter ~= '' and wait_ms > 0 then admit_wait(prefix, waiter, server_ms(), wait_ms) end
  return {-6, refused[1], refused[2], refused[3], refused[4]}
end

local function rl_uncount_inserts(prefix, n)
  local key = prefix .. 'ratelimit'
  if redis.call('HEXISTS', key, 'inserts') == 1 then redis.call('HINCRBY', key, 'inserts', -n) end
end

local function rl_may_sample(prefix, task, b)
  local a = redis.call('HMGET', prefix .. 'ratelimit', 'cfg:' .. task, 'inserts', 'sampled:' .. task)
  if not a[1] then return nil end
  local r, m, e = rl_parse(a[1])
  local inserts, samples = tonumber(a[2]) or 0, tonumber(a[3]) or 0
  if inserts < m then return false end
  local d = inserts * r - samples
  return d - b >= r * m - e or d + r > r * m + e
end

local function rl_count_sampled(prefix, task, n, now)
  if n <= 0 then return end
  redis.call('HINCRBY', prefix .. 'ratelimit', 'sampled:' .. task, n)
  admit_wake(prefix, now)
end
