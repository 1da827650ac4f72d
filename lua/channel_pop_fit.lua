--[[
  channel_pop_fit: RLinf's get_batch rule, atomically. Walk the queue from its head, taking each
  entry whose weight still fits under the target (taken + weight <= target) and stopping as soon
  as the taken weight reaches the target or the next entry would overshoot it. All or nothing;
  wakes blocked putters.

  Input:
    KEYS[1]  channel meta key    <ns>:chan:{<name>}:meta
    ARGV[1]  queue key
    ARGV[2]  target weight       a number >= 0
  Output:
    {1, entries}                 popped entries, oldest first; none when the head entry alone
                                 weighs more than the target (nothing is popped then)
    {0, last_puts_id}            every queued entry fits and together they weigh less than the
                                 target (or the queue is empty): nothing popped; XREAD the
                                 `puts` stream from last_puts_id to learn when to retry
    {-1}                         the channel does not exist
  Touches:
    <c>:meta  <c>:q:<key>  <c>:puts  <c>:gets
]]
-- @include channel

local function channel_pop_fit(KEYS, ARGV)
  local prefix = channel_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local qkey, wfield = prefix .. 'q:' .. ARGV[1], 'w:' .. ARGV[1]
  local target = tonumber(ARGV[2])
  local function not_enough() return {0, stream_last_id(prefix .. 'puts')} end

  -- Everything queued weighs less than the target: every entry fits, none reaches it.
  if tonumber(redis.call('HGET', KEYS[1], wfield) or 0) < target - 1e-9 then return not_enough() end
  local taken, sum, from = {}, 0, 0
  local done = false
  while not done do
    local chunk = redis.call('LRANGE', qkey, from, from + 127)
    if #chunk == 0 then return not_enough() end
    for i = 1, #chunk do
      local weight = entry_weight(chunk[i])
      if sum + weight > target then
        done = true
        break
      end
      taken[#taken + 1] = chunk[i]
      sum = sum + weight
      if sum >= target then
        done = true
        break
      end
    end
    from = from + #chunk
  end
  if #taken > 0 then
    redis.call('LTRIM', qkey, #taken, -1)
    channel_after_pop(KEYS[1], prefix, qkey, wfield, sum)
  end
  return {1, taken}
end
