--[[
  mark_consumed: mark samples the caller names consumed by a task (the dock's read by index, or a
  rollout it records as finished): unlike claim_ids, a sample the task consumed already may be
  named again (its bit stays set), but every sample must be alive with every required field
  produced. Samples this call newly marks count as sampled by the task's rate limiter, if it has
  one (includes/ratelimit.lua), which may wake a held-back producer; the call itself is never held
  back: its samples are named, not chosen, so waiting for inserts would not change them.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  n, then n sample ids (repeats allowed)
    then     nfields, then nfields required field names
  Output:
    {1, marked}                  every id is consumed now; `marked` of them were not before
    {0, id...}                   these ids are not alive or lack a required field; nothing marked
    {-1}                         the partition does not exist
  Touches:
    <p>:meta  <p>:alive  <p>:prod:<field>  <p>:tasks  <p>:cons:<task>
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
]]
-- @include bits
-- @include clock
-- @include prefix
-- @include ratelimit

local function mark_consumed(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local at = 2
  local ids, seen = {}, {}
  for i = 1, tonumber(ARGV[at]) do
    local id = tonumber(ARGV[at + i])
    if not seen[id] then
      seen[id] = true
      ids[#ids + 1] = id
    end
  end
  at = at + tonumber(ARGV[at]) + 1
  local fields = {unpack(ARGV, at + 1, at + tonumber(ARGV[at]))}
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end

  local ok = {}
  for i = 1, #ids do ok[i] = true end
  local function require_set(key)
    local bits = get_bits(key, ids)
    for i = 1, #ids do
      if bits[i] ~= 1 then ok[i] = false end
    end
  end
  require_set(prefix .. 'alive')
  for i = 1, #fields do require_set(prefix .. 'prod:' .. fields[i]) end
  local refused = {0}
  for i = 1, #ids do
    if not ok[i] then refused[#refused + 1] = ids[i] end
  end
  if #refused > 1 then return refused end

  redis.call('SADD', prefix .. 'tasks', task)
  local cons = prefix .. 'cons:' .. task
  local before = get_bits(cons, ids)
  local fresh = {}
  for i = 1, #ids do
    if before[i] == 0 then fresh[#fresh + 1] = ids[i] end
  end
  if #fresh > 0 then
    set_id_bits(cons, fresh)
    if rl_may_sample(prefix, task, #fresh) ~= nil then rl_count_sampled(prefix, task, #fresh, server_ms()) end
  end
  return {1, #fresh}
end
