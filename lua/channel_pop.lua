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
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local qkey, wfield = prefix .. 'q:' .. ARGV[1], 'w:' .. ARGV[1]
  local function not_enough() return {0, stream_last_id(prefix .. 'puts')} end

  if ARGV[2] == '' then
    local entry = redis.call('LPOP', qkey)
    if not entry then return not_enough() end
    channel_after_pop(KEYS[1], prefix, qkey, wfield, entry_weight(entry))
    return {1, {entry}}
  end

  local target = tonumber(ARGV[2])
  -- The running sum says whether a scan can succeed; the scan itself is the truth.
  if tonumber(redis.call('HGET', KEYS[1], wfield) or 0) < target - 1e-9 then return not_enough() end
  local taken, sum, from = {}, 0, 0
  while sum < target do
    local chunk = redis.call('LRANGE', qkey, from, from + 127)
    if #chunk == 0 then
      redis.call('HSET', KEYS[1], wfield, sum)
      return not_enough()
    end
    for i = 1, #chunk do
      taken[#taken + 1] = chunk[i]
      sum = sum + entry_weight(chunk[i])
      if sum >= target then break end
    end
    from = from + #chunk
  end
  redis.call('LTRIM', qkey, #taken, -1)
  channel_after_pop(KEYS[1], prefix, qkey, wfield, sum)
  return {1, taken}
end
