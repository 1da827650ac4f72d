--[[
  admission_config: set or remove the partition's staleness bound. With max_lag k and batch b,
  reservations (group_reserve) are admitted while the samples reserved and not freed (committed
  ones included) stay within (v + k + 1) * b, v being the trainer's published version: when the
  trainer takes b samples per version, no admitted sample is trained more than k versions after
  the version it started on. Blocked reservers are woken (the bound may be looser now).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  max_lag             an integer >= 0, or '' to remove the bound (kept as max_lag '':
                                 the namespace's default bound, see group_reserve, does not apply)
    ARGV[2]  batch               samples the trainer takes per version (>= 1; ignored with '')
  Output:
    {version, admitted, reserved}
                                 the published version ('' if none), samples admitted and not
                                 freed, and reservations in flight
  Touches:
    <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:resv
]]
-- @include clock
-- @include prefix
-- @include admitwait

local function admission_config(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local key = prefix .. 'admission'
  if ARGV[1] == '' then
    redis.call('HSET', key, 'max_lag', '')
    redis.call('HDEL', key, 'batch')
  else
    redis.call('HSET', key, 'max_lag', ARGV[1], 'batch', ARGV[2])
  end
  admit_wake(prefix, server_ms())
  local a = redis.call('HMGET', key, 'version', 'admitted')
  return {a[1] or '', tonumber(a[2]) or 0, redis.call('HLEN', prefix .. 'resv')}
end
