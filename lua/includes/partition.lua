--[[
  Partition helpers: every script receives KEYS[1] = "<ns>:{<partition>}:meta" and derives the
  partition's other keys from that prefix, so all keys share one hash slot.
]]

local function partition_prefix(meta_key)
  return string.sub(meta_key, 1, -5)
end

-- Newest event id of the partition's stream ("0-0" when there is none), so a waiting client
-- can XREAD BLOCK from exactly the state this script saw.
local function last_event_id(prefix)
  local last = redis.call('XREVRANGE', prefix .. 'events', '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end

-- Server time in ms (functions replicate their effects, so reading the clock is allowed).
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Waiting consumers of `task` (ZSET waiter -> deadline ms) and the tokens that wake them (LIST,
-- one BLPOP each). Both expire on their own, so a consumer that died leaves nothing for good.
local WAIT_KEY_TTL_MS = 60000

local function keep_alive(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end

-- Wake one waiting consumer of `task`, unless there are already as many tokens as waiters.
-- Returns how many consumers wait.
local function wake_one(prefix, task, now_ms)
  local waiters = prefix .. 'waiters:' .. task
  redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now_ms)
  local n = redis.call('ZCARD', waiters)
  if n == 0 then
    redis.call('SREM', prefix .. 'waittasks', task)
    return 0
  end
  local wake = prefix .. 'wake:' .. task
  if redis.call('LLEN', wake) < n then
    redis.call('RPUSH', wake, '1')
    keep_alive(wake, WAIT_KEY_TTL_MS)
  end
  return n
end

-- Record `waiter` as waiting for `task` for up to `timeout_ms`.
local function register_waiter(prefix, task, waiter, timeout_ms)
  local waiters = prefix .. 'waiters:' .. task
  redis.call('ZADD', waiters, server_ms() + timeout_ms, waiter)
  redis.call('SADD', prefix .. 'waittasks', task)
  keep_alive(waiters, timeout_ms + WAIT_KEY_TTL_MS)
  keep_alive(prefix .. 'waittasks', timeout_ms + WAIT_KEY_TTL_MS)
end

-- Something changed: wake one waiting consumer per task, instead of every consumer racing for
-- one sample. The woken one passes the baton on (see claim): after taking samples, and after
-- finding samples it cannot use (a smaller batch may fit another waiter), the latter at most once
-- per waiter per event (`wakebudget`), so waiters that cannot be served never wake each other
-- in a loop.
local function wake_waiters(prefix)
  local tasks = redis.call('SMEMBERS', prefix .. 'waittasks')
  if #tasks == 0 then return end
  local now_ms = server_ms()
  for i = 1, #tasks do
    local n = wake_one(prefix, tasks[i], now_ms)
    if n > 0 then redis.call('SET', prefix .. 'wakebudget:' .. tasks[i], n, 'PX', WAIT_KEY_TTL_MS) end
  end
end

-- After a claim that handed samples out: wake one more waiter of the task, if it has any.
local function pass_baton(prefix, task)
  if redis.call('SISMEMBER', prefix .. 'waittasks', task) == 1 then wake_one(prefix, task, server_ms()) end
end

-- After a claim that found too few samples: if some are ready, let another waiter try them.
local function pass_unused(prefix, task, any_ready)
  local budget = prefix .. 'wakebudget:' .. task
  if tonumber(redis.call('GET', budget) or '0') <= 0 or not any_ready() then return end
  redis.call('DECR', budget)
  wake_one(prefix, task, server_ms())
end

-- Append an event and wake waiting consumers; the stream is capped, it serves tools and the
-- wrappers that follow a partition (dock, streaming) as well.
local function emit(prefix, kind, ...)
  redis.call('XADD', prefix .. 'events', 'MAXLEN', '~', 1000, '*', 'type', kind, ...)
  wake_waiters(prefix)
end

-- Field schemas. A client offers each field's schema as canonical JSON ({"dtype","kind","shape"},
-- keys sorted). By default a field whose shape or dtype varies between puts is widened, as the
-- reference system does: tensor kinds become one jagged (or strided) field, numpy arrays an
-- ndarray field of any shape, anything else "mixed"; every value carries its own header, so
-- reads rebuild it exactly. A schema offered with a leading '!' is strict: it must equal the
-- registered one.
local TENSOR_KINDS = {tensor = true, jagged = true, strided = true}

local function json_or_nil(value)
  if value == nil or value == cjson.null then return nil end
  return value
end

local function schema_text(dtype, kind)
  local d = dtype and ('"' .. dtype .. '"') or 'null'
  return '{"dtype":' .. d .. ',"kind":"' .. kind .. '","shape":null}'
end

-- Numpy byte/unicode strings of different lengths share a dtype family ("<U5", "<U7" -> "<U").
local function dtype_family(dtype)
  if dtype and (string.sub(dtype, 2, 2) == 'S' or string.sub(dtype, 2, 2) == 'U') then
    return string.sub(dtype, 1, 2)
  end
  return dtype
end

local function widen_schema(registered, offered)
  local r, o = cjson.decode(registered), cjson.decode(offered)
  local rd, od = json_or_nil(r.dtype), json_or_nil(o.dtype)
  if TENSOR_KINDS[r.kind] and TENSOR_KINDS[o.kind] then
    local kind = (r.kind == 'strided' or o.kind == 'strided') and 'strided' or 'jagged'
    return schema_text(rd == od and rd or 'mixed', kind)
  end
  if r.kind == 'ndarray' and o.kind == 'ndarray' then
    local rf, of = dtype_family(rd), dtype_family(od)
    return schema_text(rf == of and rf or 'mixed', 'ndarray')
  end
  if r.kind == 'object' and o.kind == 'object' then return registered end
  return schema_text(nil, 'mixed')
end

local function strict_schema(offered)
  if string.sub(offered, 1, 1) == '!' then return true, string.sub(offered, 2) end
  return false, offered
end

-- Returns nil when no strict schema differs from its registered one, else {field, registered}.
local function schema_conflict(prefix, fields_and_schemas)
  for i = 1, #fields_and_schemas, 2 do
    local strict, offered = strict_schema(fields_and_schemas[i + 1])
    if strict then
      local registered = redis.call('HGET', prefix .. 'fields', fields_and_schemas[i])
      if registered and registered ~= offered then
        return {fields_and_schemas[i], registered}
      end
    end
  end
  return nil
end

-- Register each field's schema, widening one that differs from what is registered.
local function register_schemas(prefix, fields_and_schemas)
  local key = prefix .. 'fields'
  for i = 1, #fields_and_schemas, 2 do
    local _, offered = strict_schema(fields_and_schemas[i + 1])
    local registered = redis.call('HGET', key, fields_and_schemas[i])
    if not registered then
      redis.call('HSET', key, fields_and_schemas[i], offered)
    elseif registered ~= offered then
      local widened = widen_schema(registered, offered)
      if widened ~= registered then redis.call('HSET', key, fields_and_schemas[i], widened) end
    end
  end
end

-- Ids among `ids` whose alive bit is not set (never inserted, or cleared).
local function missing_ids(prefix, ids)
  local bits = get_bits(prefix .. 'alive', ids)
  local missing = {}
  for i = 1, #ids do
    if bits[i] == 0 then missing[#missing + 1] = ids[i] end
  end
  return missing
end

-- HMGET of many members, chunked so unpack() stays within Lua's C stack.
local function hmget_many(key, members)
  local out = {}
  for from = 1, #members, BITFIELD_CHUNK do
    local got = redis.call('HMGET', key, unpack(members, from, math.min(#members, from + BITFIELD_CHUNK - 1)))
    for j = 1, #got do out[#out + 1] = got[j] end
  end
  return out
end

-- Per-sample tags of `ids`: flat {name1, {json...}, name2, {json...}, ...}.
local function read_tags(prefix, ids)
  local out = {}
  if #ids == 0 then return out end
  local names = redis.call('SMEMBERS', prefix .. 'tagnames')
  for i = 1, #names do
    out[#out + 1] = names[i]
    out[#out + 1] = hmget_many(prefix .. 'tag:' .. names[i], ids)
  end
  return out
end

-- Flat {field1, schema1, ...} of the requested fields (false where unknown).
local function read_schemas(prefix, fields)
  local out = {}
  if #fields == 0 then return out end
  local schemas = redis.call('HMGET', prefix .. 'fields', unpack(fields))
  for i = 1, #fields do
    out[#out + 1] = fields[i]
    out[#out + 1] = schemas[i]
  end
  return out
end
