--[[
  reset_consumption: let a task (or every task) consume the partition's samples again.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name, or '' for every task of the partition
  Output:
    1 if the partition exists (reset done), 0 if it does not
  Touches:
    <p>:meta  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:sampled:<task>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field> (reading, to check a waiter's need)
]]
-- @include events
-- @include prefix

local function reset_consumption(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
  local tasks
  if ARGV[1] == '' then
    tasks = redis.call('SMEMBERS', prefix .. 'tasks')
  else
    tasks = {ARGV[1]}
  end
  for i = 1, #tasks do
    redis.call('UNLINK', prefix .. 'cons:' .. tasks[i], prefix .. 'lease:' .. tasks[i],
               prefix .. 'dlv:' .. tasks[i], prefix .. 'poison:' .. tasks[i], prefix .. 'sampled:' .. tasks[i])
  end
  emit(prefix, 'reset', 'tasks', table.concat(tasks, ','))
  return 1
end
