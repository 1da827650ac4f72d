--[[
  groups: the inserts of a partition, so GRPO groups can be aligned to the start of the insert that
  put them. <p>:groups (HASH first id -> count, written by `insert`) is mirrored into the sorted
  <p>:groupidx (ZSET of first ids), so the insert holding an id is one ZREVRANGEBYSCORE away.

  Offers:
    insert_finder(prefix)        a lookup x -> first, count of the insert holding x (nil if none)
    sync_group_index(prefix), rebuild_group_index(prefix), GROUPIDX_TTL_MS   the mirror's upkeep
  Touches:
    <p>:groups  <p>:groupidx
]]
-- @include chunks

-- The inserts of a partition by first id, mirrored from the `groups` HASH (first id -> count)
-- into the ZSET `<prefix>groupidx`, so the insert holding an id is one ZREVRANGEBYSCORE away.
-- Synced lazily by walking forward from the newest known insert; rebuilt from the HASH when
-- the walk cannot account for every insert (out-of-order or failed inserts, a dropped and
-- re-created partition). The TTL lets the mirror of a dropped partition go away by itself.
local GROUPIDX_TTL_MS = 86400000

local function rebuild_group_index(prefix)
  local idx = prefix .. 'groupidx'
  redis.call('DEL', idx)
  local firsts = redis.call('HKEYS', prefix .. 'groups')
  local zargs = {}
  for i = 1, #firsts do
    zargs[#zargs + 1] = firsts[i]
    zargs[#zargs + 1] = firsts[i]
    if #zargs >= 2 * CHUNK then
      redis.call('ZADD', idx, unpack(zargs))
      zargs = {}
    end
  end
  if #zargs > 0 then redis.call('ZADD', idx, unpack(zargs)) end
  redis.call('PEXPIRE', idx, GROUPIDX_TTL_MS)
end

local function sync_group_index(prefix)
  local groups, idx = prefix .. 'groups', prefix .. 'groupidx'
  local hlen, zcard = redis.call('HLEN', groups), redis.call('ZCARD', idx)
  if hlen == zcard then return end
  if zcard == 0 or zcard > hlen then return rebuild_group_index(prefix) end
  local last = tonumber(redis.call('ZREVRANGE', idx, 0, 0)[1])
  local count = tonumber(redis.call('HGET', groups, last))
  if not count then return rebuild_group_index(prefix) end
  local nxt = last + count
  while zcard < hlen do
    count = tonumber(redis.call('HGET', groups, nxt))
    if not count then return rebuild_group_index(prefix) end
    redis.call('ZADD', idx, nxt, nxt)
    zcard = zcard + 1
    nxt = nxt + count
  end
  redis.call('PEXPIRE', idx, GROUPIDX_TTL_MS)
end

-- A lookup of the insert {first, count} holding an id (nil if none), caching the last hit.
local function insert_finder(prefix)
  sync_group_index(prefix)
  local first, count = -1, 0
  local rebuilt = false
  local function find(x)
    if x >= first and x < first + count then return first, count end
    for _ = 1, 2 do
      local got = redis.call('ZREVRANGEBYSCORE', prefix .. 'groupidx', x, '-inf', 'LIMIT', 0, 1)
      if #got > 0 then
        local f = tonumber(got[1])
        local c = tonumber(redis.call('HGET', prefix .. 'groups', f))
        if c and x < f + c then
          first, count = f, c
          return f, c
        end
      end
      if rebuilt then return nil end
      rebuild_group_index(prefix) -- the mirror is stale; rebuild once per claim
      rebuilt = true
    end
    return nil
  end
  return find
end
