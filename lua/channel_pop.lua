--[[
  channel_pop: take entries from the head of a channel queue: one entry, or the fewest head
  entries whose weights sum to at least a target. All or nothing; wakes blocked putters.

  Input:
    KEYS[1]  channel meta key    <ns>:chan:{<name>}:meta
    ARGV[1]  queue key
    ARGV[2]  target weight       '' = pop exactly one entry; a number > 0 = pop by weight
  Output:
    {1, entries}                 popped entries, oldest first
    {0, last_puts_id}            not enough queued; nothing popped; XREAD the `puts` stream from
                                 last_puts_id to learn when to retry
    {-1}                         the channel does not exist
  Touches:
    <c>:meta  <c>:q:<key>  <c>:puts  <c>:gets
]]
-- @include channel

local function channel_pop(KEYS, ARGV)
  local prefix = channel_prefix(KEYS[1])
  local qkey, wfield = channel_queue(KEYS[1], prefix, ARGV[1])
  if not qkey then return {-1} end

  if ARGV[2] == '' then
    local entry = redis.call('LPOP', qkey)
    if not entry then return {0, stream_last_id(prefix .. 'puts')} end
    channel_after_pop(KEYS[1], prefix, qkey, wfield, entry_weight(entry))
    return {1, {entry}}
  end

  local target = tonumber(ARGV[2])
  local taken, sum = {}, 0
  local reached = channel_scan(KEYS[1], qkey, wfield, target, function(entry, weight)
    taken[#taken + 1] = entry
    sum = sum + weight
    return sum >= target
  end)
  if reached == false then  -- the queue weighs less than its running sum said: correct the sum
    redis.call('HSET', KEYS[1], wfield, sum)
  end
  if not reached then return {0, stream_last_id(prefix .. 'puts')} end
  redis.call('LTRIM', qkey, #taken, -1)
  channel_after_pop(KEYS[1], prefix, qkey, wfield, sum)
  return {1, taken}
end
