--[[
  ready_ids: the whole ready set of a task, for a user's Python sampler to choose from (the
  built-in samplers run inside `claim` instead). Lapsed leases of the task are handed back
  first, as in `claim`. Nothing is marked: the client claims its choice with `claim_ids`.
  Cost: O(partition) bitmap work (BITOP), as the list handed to Python is.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  max_deliveries      0 = unlimited; lapsed samples delivered this often go to poison
    ARGV[3]  nfields
    ARGV[4..3+nfields]           required field names
  Output:
    {last_event_id, ready_bitmap, next_lapse_ms}
      last_event_id              stream id to XREAD BLOCK from if the sampler takes nothing
      ready_bitmap               bit i set = sample i is ready for the task ('' if none)
      next_lapse_ms              ms until the task's earliest lease lapses (server clock), -1 if none
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:counters
    <p>:tmp:ready  <p>:tmp:overlap
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
]]
-- @include events
-- @include leases
-- @include prefix
-- @include ready

local function ready_ids(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local max_deliveries = tonumber(ARGV[2])
  local fields = {unpack(ARGV, 4, 3 + tonumber(ARGV[3]))}
  if redis.call('EXISTS', KEYS[1]) == 0 then
    return {last_event_id(prefix), '', -1}
  end
  redis.call('SADD', prefix .. 'tasks', task)
  release_lapsed(prefix, task, max_deliveries)
  local bitmap = ''
  local ready = compute_ready(prefix, task, fields)
  if ready then
    bitmap = redis.call('GET', ready) or ''
    redis.call('DEL', ready)
  end
  return {last_event_id(prefix), bitmap, next_lapse_in(prefix, task)}
end
