--[[
  channel_put: append an entry to a channel queue unless the queue is full (FIFO per key across
  every client), and wake blocked getters.

  Input:
    KEYS[1]  channel meta key    <ns>:chan:{<ns>/<name>}:meta
    ARGV[1]  queue key           e.g. 'default'
    ARGV[2]  entry               "<weight>|<payload>"
  Output:
    {1, qsize}                   appended (qsize after it); a `puts` event is emitted
    {0, last_gets_id}            the queue holds maxsize entries; nothing written; XREAD the
                                 `gets` stream from last_gets_id to learn when to retry
    {-1}                         the channel does not exist
  Touches:
    <c>:meta  <c>:q:<key>  <c>:puts  <c>:gets
]]
-- @include channel

local function channel_put(KEYS, ARGV)
  local prefix = channel_prefix(KEYS[1])
  local maxsize = redis.call('HGET', KEYS[1], 'maxsize')
  if not maxsize then return {-1} end
  local qkey = prefix .. 'q:' .. ARGV[1]
  maxsize = tonumber(maxsize)
  if maxsize > 0 and redis.call('LLEN', qkey) >= maxsize then
    return {0, stream_last_id(prefix .. 'gets')}
  end
  local size = redis.call('RPUSH', qkey, ARGV[2])
  redis.call('HINCRBYFLOAT', KEYS[1], 'w:' .. ARGV[1], entry_weight(ARGV[2]))
  redis.call('XADD', prefix .. 'puts', 'MAXLEN', '~', 1000, '*', 'key', ARGV[1])
  return {1, size}
end
