--[[
  clock: the server's clock, the one clock every deadline is read from (lease deadlines, lapses and
  extensions, waiters' deadlines). No client clock is ever compared with a deadline: hosts' clocks
  differ, and a consumer whose clock is ahead would take over live leases, one that lags would
  hand out leases that are lapsed already. Functions replicate their effects, so reading TIME in a
  script that writes is allowed (on Redis 7.0 as on Valkey).

  Offers:
    server_ms()   the server's time in ms
  Touches:
    nothing
]]

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
