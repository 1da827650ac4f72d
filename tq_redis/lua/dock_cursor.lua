--[[
  dock_cursor: take the next `count` positions of one of a dock's cursors: 'rows' (the next free
  row, for puts without indexes; kept in <p>:meta's `dock_cursor`, which goes with the partition)
  or 'requests' (MindSpeed's prefetch_request_index, in <p>:dockstate's `cur_index`, which a
  clear resets). With an end, a cursor at or past it does not move (MindSpeed hands out nothing
  past the dock's last row).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  cursor              'rows' or 'requests'
    ARGV[2]  count               positions to take
    ARGV[3]  end                 '' = none; else the cursor does not move once it is >= end
  Output:
    the first position taken (the cursor before this call), or -1: at or past `end`, not moved
  Touches:
    <p>:meta  <p>:dockstate
]]
-- @include prefix

local function dock_cursor(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local key, field = KEYS[1], 'dock_cursor'
  if ARGV[1] ~= 'rows' then key, field = prefix .. 'dockstate', 'cur_index' end
  local first = tonumber(redis.call('HGET', key, field) or '0')
  if ARGV[3] ~= '' and first >= tonumber(ARGV[3]) then return -1 end
  redis.call('HINCRBY', key, field, ARGV[2])
  return first
end
