--[[
  reservations: prompt groups a producer reserved (group_reserve) and has neither committed nor
  aborted yet, and the staleness admission they are counted against. A reservation holds ids
  taken from <p>:seq (never handed out again) and a lease on the server's clock; nothing of it is
  visible to consumers until group_commit makes the whole group alive in one step. A reservation
  whose lease lapsed is freed by the next script of this family that runs in the partition (no
  reaper process): its ids go to the trash if bytes may have been stored for them (the fields
  group_extend recorded), and the client that ran the script deletes them.

  <p>:resv          HASH token -> "first \t count \t start version \t committer \t staged field \t ..."
                    (committer: the one commit call that may store and commit the group, '' until
                    one stages; any other commit of the reservation is refused)
  <p>:resvdl        ZSET token -> lease deadline (server ms)
  <p>:admission     HASH max_lag, batch (the bound, when configured), version (the trainer's
                    published policy version), admitted (samples reserved and not freed: in
                    flight plus committed)
  <p>:admitwaiters  ZSET waiter -> deadline ms (reservers blocked by the bound)
  <p>:admitwake     LIST wake tokens for them (one per waiter when the bound may have moved)

  Offers:
    resv_get(prefix, token)                 {first, count, version, owner, fields} or nil
    resv_put(prefix, token, rec, deadline)
    resv_free(prefix, token, rec)           forget it, free its slots; 1 if its ids went to the trash
    release_expired(prefix, now)            free lapsed reservations; how many went to the trash
    resv_live(prefix, token, now)           release_expired, then resv_get: (trashed, rec or nil)
    resv_next_lapse(prefix, now)            ms until the earliest reservation lapses, -1 if none
    admit_capacity(prefix)                  samples the bound admits now (nil: no bound)
    (blocked reservers wait as includes/admitwait.lua says; a freed reservation no longer counts
    as inserted for a rate limiter, includes/ratelimit.lua)
  Touches:
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:trash  <p>:trashfields
    <p>:ratelimit
]]
-- @include admitwait
-- @include bits
-- @include ratelimit

local function resv_get(prefix, token)
  local raw = redis.call('HGET', prefix .. 'resv', token)
  if not raw then return nil end
  local parts = {}
  for part in string.gmatch(raw .. '\t', '([^\t]*)\t') do parts[#parts + 1] = part end
  return {first = tonumber(parts[1]), count = tonumber(parts[2]), version = parts[3], owner = parts[4],
          fields = {unpack(parts, 5)}}
end

local function resv_put(prefix, token, rec, deadline)
  local raw = rec.first .. '\t' .. rec.count .. '\t' .. rec.version .. '\t' .. (rec.owner or '')
  if #rec.fields > 0 then raw = raw .. '\t' .. table.concat(rec.fields, '\t') end
  redis.call('HSET', prefix .. 'resv', token, raw)
  redis.call('ZADD', prefix .. 'resvdl', deadline, token)
end

local function resv_free(prefix, token, rec)
  redis.call('HDEL', prefix .. 'resv', token)
  redis.call('ZREM', prefix .. 'resvdl', token)
  redis.call('HINCRBY', prefix .. 'admission', 'admitted', -rec.count)
  rl_uncount_inserts(prefix, rec.count)
  if #rec.fields == 0 then return 0 end
  set_bit_range(prefix .. 'trash', rec.first, rec.count, 1)
  redis.call('SADD', prefix .. 'trashfields', unpack(rec.fields))
  return 1
end

local function release_expired(prefix, now)
  local due = redis.call('ZRANGEBYSCORE', prefix .. 'resvdl', '-inf', now, 'LIMIT', 0, 256)
  local trashed = 0
  for i = 1, #due do
    local rec = resv_get(prefix, due[i])
    if rec then
      trashed = trashed + resv_free(prefix, due[i], rec)
    else
      redis.call('ZREM', prefix .. 'resvdl', due[i])
    end
  end
  if #due > 0 then admit_wake(prefix, now) end
  return trashed
end

-- What a script acting on one reservation does first: free the partition's lapsed reservations
-- (the client deletes the bytes of those trashed), then look the token up. Returns how many
-- reservations went to the trash and the record (nil: committed, aborted, or lapsed and freed).
local function resv_live(prefix, token, now)
  local trashed = release_expired(prefix, now)
  return trashed, resv_get(prefix, token)
end

local function resv_next_lapse(prefix, now)
  local first = redis.call('ZRANGE', prefix .. 'resvdl', 0, 0, 'WITHSCORES')
  if #first == 0 then return -1 end
  return math.max(0, tonumber(first[2]) - now)
end

local function admit_capacity(prefix)
  local a = redis.call('HMGET', prefix .. 'admission', 'max_lag', 'batch', 'version', 'admitted')
  local lag, batch = tonumber(a[1]), tonumber(a[2])
  if not lag or not batch then return nil end
  local version = tonumber(a[3]) or 0
  return (version + lag + 1) * batch - (tonumber(a[4]) or 0)
end
