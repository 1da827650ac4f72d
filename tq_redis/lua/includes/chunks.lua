--[[
  chunks: commands over many members, cut into pieces so unpack() stays within Lua's C stack.

  Offers:
    CHUNK                        at most this many members (or BITFIELD ops) per command
    hmget_many(key, members)     HMGET of any number of members, values aligned with members
  Touches:
    nothing of its own (keys come from the caller)
]]

local CHUNK = 1000

local function hmget_many(key, members)
  local out = {}
  for from = 1, #members, CHUNK do
    local got = redis.call('HMGET', key, unpack(members, from, math.min(#members, from + CHUNK - 1)))
    for j = 1, #got do out[#out + 1] = got[j] end
  end
  return out
end
