--[[
  rate_limit_config: set or remove a task's samples-per-insert rate limiter on the partition
  (includes/ratelimit.lua). The first limiter of a partition starts the insert count from the
  samples alive then; a task's first limiter starts its sample count from the samples it has
  consumed. Setting a limiter again keeps the counts. Waiting producers and the task's waiting
  consumers are woken (the limit may be looser now).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task
    ARGV[2]  samples_per_insert  a number > 0, or '' to remove the task's limiter
    ARGV[3]  min_size_to_sample  an integer >= 1 (ignored with '')
    ARGV[4]  error_buffer        a number >= max(1, samples_per_insert) (ignored with '')
    ARGV[5]  insert_timeout_ms   how long a refused insert waits, '' = as long as it takes
  Output:
    {inserts, samples}           the counts now (0, 0 once the limiter is removed)
  Touches:
    <p>:ratelimit  <p>:alive  <p>:cons:<task>  <p>:admitwaiters  <p>:admitwake
    <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>
    <p>:lease:<task>  <p>:prod:<field>  (what a waiter's need is checked against; not here: it wakes one)
]]
-- @include admitwait
-- @include clock
-- @include prefix
-- @include waiters

local function rate_limit_config(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local key = prefix .. 'ratelimit'
  local task = ARGV[1]
  local counts = {0, 0}
  if ARGV[2] == '' then
    redis.call('HDEL', key, 'cfg:' .. task, 'sampled:' .. task)
    local left = redis.call('HKEYS', key)
    local any = false
    for i = 1, #left do
      if string.sub(left[i], 1, 4) == 'cfg:' then any = true end
    end
    if not any then redis.call('DEL', key) end
  else
    if redis.call('HEXISTS', key, 'inserts') == 0 then
      redis.call('HSET', key, 'inserts', redis.call('BITCOUNT', prefix .. 'alive'))
    end
    if redis.call('HEXISTS', key, 'sampled:' .. task) == 0 then
      redis.call('HSET', key, 'sampled:' .. task, redis.call('BITCOUNT', prefix .. 'cons:' .. task))
    end
    redis.call('HSET', key, 'cfg:' .. task, table.concat({ARGV[2], ARGV[3], ARGV[4], ARGV[5]}, '\t'))
    local a = redis.call('HMGET', key, 'inserts', 'sampled:' .. task)
    counts = {tonumber(a[1]), tonumber(a[2])}
  end
  local now = server_ms()
  admit_wake(prefix, now)
  wake_one(prefix, task, now, false)
  return counts
end
