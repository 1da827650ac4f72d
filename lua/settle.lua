--[[
  settle: end or extend the lease of leased samples of a task (ack / nack / extend).

  Input:
    KEYS[1]  partition meta key  <ns>:{<p>}:meta
    ARGV[1]  task name
    ARGV[2]  action              'ack' (consumed for good), 'nack' (hand back now),
                                 'extend' (new deadline = now_ms + lease_ms)
    ARGV[3]  now_ms
    ARGV[4]  lease_ms            only for 'extend'
    ARGV[5..]                    sample ids
  Output:
    {settled, id...}             number of ids that were leased, then the ids that were not
                                 (already acked, lapsed and re-leased elsewhere, or never leased)
]]
local function settle(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task, action = ARGV[1], ARGV[2]
  local now_ms, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
  local lease = prefix .. 'lease:' .. task
  local held, not_held = {}, {}
  for i = 5, #ARGV do
    if redis.call('ZSCORE', lease, ARGV[i]) then
      held[#held + 1] = tonumber(ARGV[i])
    else
      not_held[#not_held + 1] = tonumber(ARGV[i])
    end
  end
  if #held > 0 then
    if action == 'extend' then
      local zargs = {}
      for i = 1, #held do
        zargs[2 * i - 1] = now_ms + lease_ms
        zargs[2 * i] = held[i]
      end
      redis.call('ZADD', lease, 'XX', unpack(zargs))
    else
      redis.call('ZREM', lease, unpack(held))
      if action == 'nack' then
        set_bits(prefix .. 'cons:' .. task, held, 0)
        emit(prefix, 'released', 'task', task, 'count', #held)
      end
    end
  end
  local out = {#held}
  for i = 1, #not_held do out[#out + 1] = not_held[i] end
  return out
end
