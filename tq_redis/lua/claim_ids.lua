--[[
  claim_ids: claim exactly the samples a user's Python sampler chose, but only if every one of
  them is still free for the task (alive, every required field produced, not consumed or
  leased by the task). Otherwise nothing is marked and the client retries with a fresh ready
  set. The reference sampler contract returns `sampled` (handed out) and `consumed` (marked);
  both must be free.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  lease_ms            0 = consumed at once; > 0 = consumed ids are leased that long,
                                 from the server's time
    ARGV[3]  nsampled, then nsampled sample ids (the batch, in the sampler's order)
    then     nconsumed, then nconsumed sample ids (marked consumed / leased)
    then     nfields, then nfields required field names
  Output:
    {1, last_event_id, ids, schemas, tags, deliveries, next_lapse_ms}
                                 claimed; the rest as in `claim` (deliveries: per sampled id,
                                 0 for a sampled id that was not consumed; empty without lease)
    {0, id...}                   these ids were no longer free; nothing marked
    {-1}                         the partition does not exist
    {-2}                         the task's rate limiter holds the claim back (includes/ratelimit.lua);
                                 nothing marked: wait for an insert, as when too few are ready
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:counters
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
    <p>:tagnames  <p>:tag:<name>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>
]]
-- @include bits
-- @include clock
-- @include events
-- @include leases
-- @include prefix
-- @include ratelimit
-- @include schemas
-- @include tags
-- @include waiters

local function claim_ids(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local lease_ms = tonumber(ARGV[2])
  local at = 3
  local sampled, consumed = {}, {}
  for i = 1, tonumber(ARGV[at]) do sampled[i] = tonumber(ARGV[at + i]) end
  at = at + #sampled + 1
  for i = 1, tonumber(ARGV[at]) do consumed[i] = tonumber(ARGV[at + i]) end
  at = at + #consumed + 1
  local fields = {unpack(ARGV, at + 1, at + tonumber(ARGV[at]))}
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  redis.call('SADD', prefix .. 'tasks', task)

  local all, seen = {}, {}
  for _, list in ipairs({sampled, consumed}) do
    for i = 1, #list do
      if not seen[list[i]] then
        seen[list[i]] = true
        all[#all + 1] = list[i]
      end
    end
  end
  local free = {}
  for i = 1, #all do free[i] = true end
  local function require_bits(key, want_value)
    local bits = get_bits(key, all)
    for i = 1, #all do
      if bits[i] ~= want_value then free[i] = false end
    end
  end
  require_bits(prefix .. 'alive', 1)
  for i = 1, #fields do require_bits(prefix .. 'prod:' .. fields[i], 1) end
  require_bits(prefix .. 'cons:' .. task, 0)
  local taken = {0}
  for i = 1, #all do
    if not free[i] then taken[#taken + 1] = all[i] end
  end
  if #taken > 1 then return taken end
  local limited = rl_may_sample(prefix, task, #sampled)
  if limited == false then return {-2} end

  local leased = mark_claimed(prefix, task, consumed, lease_ms)
  if limited ~= nil then rl_count_sampled(prefix, task, #sampled, server_ms()) end
  local deliveries = {}
  if lease_ms > 0 then
    local by_id = {}
    for i = 1, #consumed do by_id[consumed[i]] = leased[i] end
    for i = 1, #sampled do deliveries[i] = by_id[sampled[i]] or 0 end
  end
  if #sampled > 0 then pass_baton(prefix, task) end -- as claim does
  return {1, last_event_id(prefix), sampled, read_schemas(prefix, fields), read_tags(prefix, sampled), deliveries,
          next_lapse_in(prefix, task)}
end
