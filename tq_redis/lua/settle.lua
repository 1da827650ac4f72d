--[[
  settle: end or extend the leases of leased samples of a task (ack / nack / extend).
  Each sample comes with the delivery count it was handed out with, used as a fencing token:
  a lease is settled only if it is still in flight AND its delivery count is still that one,
  so a holder whose lease lapsed and was handed to someone else can no longer ack, nack or
  extend it (the new holder's lease carries a higher count). A lease past its deadline that no
  claim has handed back yet is still its holder's (nobody else was given the sample). Extensions
  run from the server's time: no client clock takes part.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  action              'ack' (consumed for good), 'nack' (hand back now),
                                 'extend' (new deadline = the server's time + lease_ms)
    ARGV[3]  lease_ms            only for 'extend'
    ARGV[4..]                    pairs of sample id, delivery count (0 = any delivery)
  Output:
    {settled, id...}             number of samples settled, then the ids this holder no longer
                                 held (lapsed and handed back or out again, nacked, or never
                                 leased). An ack sent again by the holder it already settled (the
                                 same delivery count, still consumed, not put aside as poison)
                                 counts as settled: a retried ack is not an error.
  Touches:
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field> (reading, to check a waiter's need)
]]
-- @include bits
-- @include chunks
-- @include clock
-- @include events
-- @include prefix

local function settle(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task, action = ARGV[1], ARGV[2]
  local lease_ms = tonumber(ARGV[3])
  local lease = prefix .. 'lease:' .. task
  local ids, fences = {}, {}
  for i = 4, #ARGV, 2 do
    ids[#ids + 1] = ARGV[i]
    fences[#fences + 1] = tonumber(ARGV[i + 1])
  end
  local counts = hmget_many(prefix .. 'dlv:' .. task, ids)
  local held, not_held, again = {}, {}, 0
  for i = 1, #ids do
    local count = tonumber(counts[i])
    local in_flight = redis.call('ZSCORE', lease, ids[i])
    if in_flight and (fences[i] == 0 or count == fences[i]) then
      held[#held + 1] = tonumber(ids[i])
    elseif not in_flight and action == 'ack' and fences[i] ~= 0 and count == fences[i]
        and get_bits(prefix .. 'cons:' .. task, {tonumber(ids[i])})[1] == 1
        and redis.call('SISMEMBER', prefix .. 'poison:' .. task, ids[i]) == 0 then
      again = again + 1 -- this holder's ack, sent again: it acked the sample already
    else
      not_held[#not_held + 1] = tonumber(ids[i])
    end
  end
  if #held > 0 then
    local deadline = action == 'extend' and server_ms() + lease_ms
    for from = 1, #held, CHUNK do
      local part = {unpack(held, from, math.min(#held, from + CHUNK - 1))}
      if action == 'extend' then
        local zargs = {}
        for i = 1, #part do
          zargs[2 * i - 1] = deadline
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
  local out = {#held + again}
  for i = 1, #not_held do out[#out + 1] = not_held[i] end
  return out
end
