--[[
  dock_reset: start a dock's next step after its clear: MindSpeed's request cursor
  (prefetch_request_index) and the log of metric updates go. The dock's shape stays.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
  Output:
    number of those two keys that existed
  Touches:
    <p>:dockstate  <p>:dockmetrics
]]
-- @include prefix

local function dock_reset(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  return redis.call('DEL', prefix .. 'dockstate', prefix .. 'dockmetrics')
end
