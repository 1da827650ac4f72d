--[[
  policy_version: the trainer publishes the policy version it trains now. New reservations
  (group_reserve) start on it unless they name their own, and the staleness bound admits
  (version + max_lag + 1) * batch samples in all: every reserver blocked by the bound is woken to
  try again. A version never goes back.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  version             an integer >= 0
  Output:
    {1, previous}                published; previous: the version before ('' if none)
    {0, current}                 refused: `current`, published before, is higher
  Touches:
    <p>:admission  <p>:admitwaiters  <p>:admitwake
]]
-- @include clock
-- @include prefix
-- @include admitwait

local function policy_version(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local current = redis.call('HGET', prefix .. 'admission', 'version')
  if current and tonumber(current) > tonumber(ARGV[1]) then return {0, current} end
  redis.call('HSET', prefix .. 'admission', 'version', ARGV[1])
  admit_wake(prefix, server_ms())
  return {1, current or ''}
end
