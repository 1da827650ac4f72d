--[[
  dock_metric: append one `update_metrics` call to a dock's log of metric updates, which
  `get_metrics` replays in order (an append never loses a concurrent one); a clear empties it.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  entry               the encoded update (key, value, cumulate)
  Output:
    number of updates in the log now
  Touches:
    <p>:dockmetrics
]]
-- @include prefix

local function dock_metric(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  return redis.call('RPUSH', prefix .. 'dockmetrics', ARGV[1])
end
