--[[
  settle: end or extend the leases of leased samples of a task (ack / nack / extend).
  Each sample comes with the delivery count it was handed out with, used as a fencing token:
  a lease is settled only if it is still in flight AND its delivery count is still that one,
  so a holder whose lease lapsed and was handed to someone else can no longer ack, nack or
  extend it (the new holder's lease carries a higher count).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  action              'ack' (consumed for good), 'nack' (hand back now),
                                 'extend' (new deadline = now_ms + lease_ms)
    ARGV[3]  now_ms
    ARGV[4]  lease_ms            only for 'extend'
    ARGV[5..]                    pairs of sample id, delivery count (0 = any delivery)
  Output:
    {settled, id...}             number of samples settled, then the ids that were not held
                                 (already acked, lapsed and re-leased, or never leased)
  Touches:
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field> (reading, to check a waiter's need)
]]
-- @include bits
-- @include chunks
-- @include events
-- @include prefix

local function settle(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task, action = ARGV[1], ARGV[2]
  local now_ms, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
  local lease = prefix .. 'lease:' .. task
  local ids, fences = {}, {}
  for i = 5, #ARGV, 2 do
    ids[#ids + 1] = ARGV[i]
    fences[#fences + 1] = tonumber(ARGV[i + 1])
  end
  local counts = hmget_many(prefix .. 'dlv:' .. task, ids)
  local held, not_held = {}, {}
  for i = 1, #ids do
    local in_flight = redis.call('ZSCORE', lease, ids[i])
    if in_flight and (fences[i] == 0 or tonumber(counts[i]) == fences[i]) then
      held[#held + 1] = tonumber(ids[i])
    else
      not_held[#not_held + 1] = tonumber(ids[i])
    end
  end
  if #held > 0 then
    for from = 1, #held, CHUNK do
      local part = {unpack(held, from, math.min(#held, from + CHUNK - 1))}
      if action == 'extend' then
        local zargs = {}
        for i = 1, #part do
          zargs[2 * i - 1] = now_ms + lease_ms
          zargs[2 * i] = part[i]
        end
        redis.call('ZADD', lease, 'XX', unpack(zargs))
      else
        redis.call('ZREM', lease, unpack(part))
      end
    end
    if action == 'nack' then
      set_bits(prefix .. 'cons:' .. task, held, 0)
      emit(prefix, 'released', 'task', task, 'count', #held)
    end
  end
  local out = {#held}
  for i = 1, #not_held do out[#out + 1] = not_held[i] end
  return out
end
