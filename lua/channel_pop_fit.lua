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
  local qkey, wfield = channel_queue(KEYS[1], prefix, ARGV[1])
  if not qkey then return {-1} end

  local target = tonumber(ARGV[2])
  local taken, sum = {}, 0
  local stopped = channel_scan(KEYS[1], qkey, wfield, target, function(entry, weight)
    if sum + weight > target then return true end  -- the next entry would overshoot
    taken[#taken + 1] = entry
    sum = sum + weight
    return sum >= target
  end)
  -- Not stopped: every queued entry fits and together they weigh less than the target.
  if not stopped then return {0, stream_last_id(prefix .. 'puts')} end
  if #taken > 0 then
    redis.call('LTRIM', qkey, #taken, -1)
    channel_after_pop(KEYS[1], prefix, qkey, wfield, sum)
  end
  return {1, taken}
end
