--[[
  group_reserve: reserve `count` sample ids (a prompt group) for a producer, with a lease on the
  server's clock and the policy version the group starts on. Nothing becomes visible: the
  producer stores the group's bytes (after group_extend records their fields) and group_commit
  makes the whole group alive at once; group_abort or the lease's lapse frees it. Lapsed
  reservations of the partition are freed first.
  With a staleness bound (admission_config), the reservation is admitted only while the samples
  reserved and not freed stay within (version + max_lag + 1) * batch (version: the trainer's
  published one, see policy_version); otherwise nothing is reserved and, with a waiter, the
  caller is registered to be woken when the bound may have moved (a version bump, a freed
  reservation): it BLPOPs <p>:admitwake, at most until the next reservation lapses. A rate
  limiter of the partition (includes/ratelimit.lua) may hold the group back the same way (a
  consumer's claim wakes it); a reservation freed without its commit takes back its count.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  token               the reservation's id (unique per reservation)
    ARGV[2]  count               ids to reserve (>= 1)
    ARGV[3]  lease_ms            how long it lives without group_extend (server time)
    ARGV[4]  version             the policy version it starts on; '' = the published version
                                 ('' again when none is published)
    ARGV[5]  waiter              '' or the caller's waiter id (registered when refused)
    ARGV[6]  wait_ms             how long that waiter waits at most
    ARGV[7]  default_max_lag     the namespace's bound (init's staleness config), '' if none: a
    ARGV[8]  default_batch       partition that never had a bound of its own adopts it
  Output:
    {1, trashed, first_id, version, deadline_ms}
                                 reserved ids first_id .. first_id + count - 1
    {-5, trashed, version, capacity, next_lapse_ms}
                                 refused by the staleness bound: only `capacity` samples are
                                 admitted at the published `version`; next_lapse_ms: when the
                                 earliest reservation lapses (-1: none)
    {-6, trashed, task, inserts, samples, timeout_ms}
                                 held back by `task`'s rate limiter (includes/ratelimit.lua) at
                                 these counts; the waiter is registered as for -5
    {-3, trashed}                the partition is sealed
    {-4, trashed}                the partition was sealed and cleared (closed)
    trashed: how many lapsed reservations had their ids put in the trash (the client deletes their bytes)
  Touches:
    <p>:meta  <p>:seq  <p>:closed
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:trash  <p>:trashfields
    <p>:ratelimit
]]
-- @include admitwait
-- @include clock
-- @include prefix
-- @include ratelimit
-- @include reservations

local function group_reserve(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local count, lease_ms, waiter = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[5]
  local now = server_ms()
  local trashed = release_expired(prefix, now)
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then return {-3, trashed} end
  if redis.call('EXISTS', prefix .. 'closed') == 1 then return {-4, trashed} end
  if (ARGV[7] or '') ~= '' and redis.call('HEXISTS', prefix .. 'admission', 'max_lag') == 0 then
    redis.call('HSET', prefix .. 'admission', 'max_lag', ARGV[7], 'batch', ARGV[8])
  end
  local published = redis.call('HGET', prefix .. 'admission', 'version') or ''
  local capacity = admit_capacity(prefix)
  if capacity and count > capacity then
    local wait_ms = tonumber(ARGV[6]) or 0
    if waiter ~= '' and wait_ms > 0 then admit_wait(prefix, waiter, now, wait_ms) end
    return {-5, trashed, published, capacity, resv_next_lapse(prefix, now)}
  end
  local held = insert_held(prefix, count, waiter, ARGV[6])
  if held then return {-6, trashed, held[2], held[3], held[4], held[5]} end
  local first = redis.call('INCRBY', prefix .. 'seq', count) - count
  local version = ARGV[4] ~= '' and ARGV[4] or published
  local deadline = now + lease_ms
  resv_put(prefix, ARGV[1], {first = first, count = count, version = version, owner = '', fields = {}}, deadline)
  redis.call('HINCRBY', prefix .. 'admission', 'admitted', count)
  return {1, trashed, first, version, deadline}
end
