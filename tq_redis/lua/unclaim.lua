--[[
  unclaim: hand back samples a claim of this client just took, as if it had not been made: the
  claim's durable-mode wait found it unconfirmed (NotDurable), and a failover could lose the claim
  and give its samples to another consumer while this one works on them. Handing them back at
  once keeps "at most once" (fetch) and "acknowledged once" (leases) whatever the failover keeps.
  A leased sample goes back only while its lease is still the one this claim took (its delivery
  count), and that delivery is not counted; a sample claimed without a lease is unmarked.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2..]                    pairs of sample id, delivery count the claim gave it (0: no lease)
  Output:
    number of samples handed back (a `released` event wakes the task's waiters when > 0)
  Touches:
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field> (reading, to check a waiter's need)
]]
-- @include bits
-- @include chunks
-- @include events
-- @include prefix

local function unclaim(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local lease, dlv = prefix .. 'lease:' .. task, prefix .. 'dlv:' .. task
  local ids, fences = {}, {}
  for i = 2, #ARGV, 2 do
    ids[#ids + 1] = ARGV[i]
    fences[#fences + 1] = tonumber(ARGV[i + 1])
  end
  local counts = hmget_many(dlv, ids)
  local back = {}
  for i = 1, #ids do
    if fences[i] == 0 then
      back[#back + 1] = tonumber(ids[i])
    elseif tonumber(counts[i]) == fences[i] and redis.call('ZREM', lease, ids[i]) == 1 then
      if fences[i] > 1 then redis.call('HSET', dlv, ids[i], fences[i] - 1) else redis.call('HDEL', dlv, ids[i]) end
      back[#back + 1] = tonumber(ids[i])
    end
  end
  if #back > 0 then
    set_bits(prefix .. 'cons:' .. task, back, 0)
    emit(prefix, 'released', 'task', task, 'count', #back)
  end
  return #back
end
