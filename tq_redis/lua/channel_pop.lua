--[[
  channel_pop: take entries from the head of a channel queue by one of three rules, all or
  nothing, and wake blocked putters:
    one     the head entry
    reach   the fewest head entries whose weights sum to at least the target
    fit     RLinf's get_batch rule: walk from the head taking each entry whose weight still fits
            under the target (taken + weight <= target), stopping as soon as the taken weight
            reaches the target or the next entry would overshoot it

  Input:
    KEYS[1]  channel meta key    <ns>:chan:{<ns>/<name>}:meta
    ARGV[1]  queue key
    ARGV[2]  rule                one | reach | fit
    ARGV[3]  target weight       a number (reach: > 0, fit: >= 0); ignored by `one`
  Output:
    {1, entries}                 popped entries, oldest first (fit: none when the head entry
                                 alone weighs more than the target; nothing is popped then)
    {0, last_puts_id}            not enough queued (fit: every queued entry fits and together
                                 they weigh less than the target); nothing popped; XREAD the
                                 `puts` stream from last_puts_id to learn when to retry
    {-1}                         the channel does not exist
  Touches:
    <c>:meta  <c>:q:<key>  <c>:puts  <c>:gets
]]
-- @include channel

local function channel_pop(KEYS, ARGV)
  local prefix = channel_prefix(KEYS[1])
  local qkey, wfield = channel_queue(KEYS[1], prefix, ARGV[1])
  if not qkey then return {-1} end
  local rule = ARGV[2]

  if rule == 'one' then
    local entry = redis.call('LPOP', qkey)
    if not entry then return {0, stream_last_id(prefix .. 'puts')} end
    channel_after_pop(KEYS[1], prefix, qkey, wfield, entry_weight(entry))
    return {1, {entry}}
  end

  local target = tonumber(ARGV[3])
  local taken, sum = {}, 0
  local stopped = channel_scan(KEYS[1], qkey, wfield, target, function(entry, weight)
    if rule == 'fit' and sum + weight > target then return true end  -- the next would overshoot
    taken[#taken + 1] = entry
    sum = sum + weight
    return sum >= target
  end)
  if rule == 'reach' and stopped == false then
    -- the queue weighs less than its running sum said: correct the sum
    redis.call('HSET', KEYS[1], wfield, sum)
  end
  if not stopped then return {0, stream_last_id(prefix .. 'puts')} end
  if #taken > 0 then
    redis.call('LTRIM', qkey, #taken, -1)
    channel_after_pop(KEYS[1], prefix, qkey, wfield, sum)
  end
  return {1, taken}
end
