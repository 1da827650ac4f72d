--[[
  seal_partition: record that no more samples will be inserted into a partition, and wake every
  waiting reader so streaming loaders can end once they have drained it. Creates the partition
  if needed (a producer may seal before its first put, or with nothing to put). Idempotent.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  now_ms              creation time if this call creates the partition
  Output:
    1 if this call sealed it, 0 if it was sealed already
  Touches:
    <p>:meta
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field>  <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include events
-- @include prefix

local function seal_partition(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  redis.call('HSETNX', KEYS[1], 'created_ms', ARGV[1])
  if redis.call('HSETNX', KEYS[1], 'sealed', 1) == 0 then return 0 end
  emit(prefix, 'sealed')
  return 1
end
