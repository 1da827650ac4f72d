--[[
  requests: run a state-changing script at most once per request id. tq_redis/server/library.py
  registers every script that writes through `recorded`; the client (tq_redis/client/plans.py)
  gives each logical call one request id and passes its record key <p>:rq:<id> (or <c>:rq:<id>)
  as the LAST key, in the slot of KEYS[1]. A call whose reply was lost is sent again with the
  same key: it gets the reply recorded the first time instead of running twice.

  The record is the script's reply packed with cmsgpack (Redis and Valkey carry it; where a server
  has none, as fakeredis, a small tagged format written here), which keeps what Redis would make
  of the reply: integers exactly, floats (truncated when sent as before), strings byte for byte, true as 1, false as nil,
  an array up to its first nil, {ok=...} status replies. A reply {err=...} and a script that raises
  are not recorded: a retry runs again and fails again. The record lives request_records.ms (two
  minutes): longer than any retry of one call (redis-py's reconnects give up after ~6 s; a driver
  retry follows at once), short enough that records cost memory for two minutes of calls only.
  A call without a record key (a read, or a caller that does not retry) runs as before. A claim that
  handed nothing out is not recorded (request_records.handed_out): running it again is harmless.

  Offers:
    request_records              the records' lifetime (.ms, two minutes) and format (.pack turns a
                                 reply into its record, .unpack a record back into the reply);
                                 .handed_out, the rule that a claim is recorded only with ids
    recorded(fn, KEYS, ARGV, keep)  the reply of the script fn run without the record key, or the recorded
                                 one; with a 4th argument, a rule of request_records (.handed_out,
                                 claim's), a reply is recorded only where the rule holds
  Touches:
    <p>:rq:*
]]
-- @include prefix

-- one table, not seven locals: the library's chunk is near Lua's 200 locals
local request_records = {ms = 120000}

-- whether the server has cmsgpack, asked at the first record and remembered (a library may not call
-- pcall while it loads; a server without cmsgpack refuses even a read of the missing global)
function request_records.msgpack()
  if request_records.has_msgpack == nil then
    local ok, found = pcall(function() return cmsgpack end)
    request_records.has_msgpack = ok and found ~= nil
  end
  return request_records.has_msgpack
end

-- the record of a server without cmsgpack: tagged, length-prefixed (binary-safe; only test doubles)
function request_records.write(out, v)
  local t = type(v)
  if t == 'string' then
    out[#out + 1] = 's' .. #v .. ':' .. v
  elseif t == 'number' then
    out[#out + 1] = 'n' .. string.format('%.17g', v) .. ':'
  elseif t == 'boolean' then
    out[#out + 1] = v and 't' or 'f'
  elseif t == 'table' and v.ok ~= nil then
    out[#out + 1] = 'o' .. #v.ok .. ':' .. v.ok
  elseif t == 'table' then
    local n = 0
    while v[n + 1] ~= nil do n = n + 1 end
    out[#out + 1] = 'a' .. n .. ':'
    for i = 1, n do request_records.write(out, v[i]) end
  else
    out[#out + 1] = 'f'
  end
end

function request_records.read(s, at)
  local tag = string.sub(s, at, at)
  if tag == 't' then return true, at + 1 end
  if tag == 'f' then return false, at + 1 end
  local colon = string.find(s, ':', at + 1, true)
  local head = string.sub(s, at + 1, colon - 1)
  if tag == 'n' then return tonumber(head), colon + 1 end
  local n = tonumber(head)
  if tag == 's' then return string.sub(s, colon + 1, colon + n), colon + n + 1 end
  if tag == 'o' then return {ok = string.sub(s, colon + 1, colon + n)}, colon + n + 1 end
  local list, pos = {}, colon + 1
  for i = 1, n do list[i], pos = request_records.read(s, pos) end
  return list, pos
end

function request_records.pack(reply)
  if request_records.msgpack() then return 'm' .. cmsgpack.pack(reply) end
  local out = {'w'}
  request_records.write(out, reply)
  return table.concat(out)
end

function request_records.unpack(record)
  if string.sub(record, 1, 1) == 'm' then return cmsgpack.unpack(string.sub(record, 2)) end
  return (request_records.read(record, 2))
end

-- claim's keep rule: a claim that handed nothing out is not recorded. Its rerun is harmless (it
-- hands back the same lapsed leases, none the second time, and registers the same waiter again)
-- and may find samples that arrived meanwhile; the empty claims of a waiting consumer are the most
-- frequent calls there are, and a record of each cost them one key write.
function request_records.handed_out(reply)
  return type(reply[2]) ~= 'table' or #reply[2] > 0
end

local function recorded(fn, KEYS, ARGV, keep)
  local n = #KEYS
  if n < 2 then return fn(KEYS, ARGV) end
  local record = KEYS[n]
  local prefix = partition_prefix(KEYS[1])
  if string.sub(record, 1, #prefix + 3) ~= prefix .. 'rq:' then
    return redis.error_reply('ERR tq_redis: the last key must be the request record ' .. prefix .. 'rq:<id>')
  end
  KEYS[n] = nil
  local seen = redis.call('GET', record)
  if seen then return request_records.unpack(seen) end
  local reply = fn(KEYS, ARGV)
  if type(reply) ~= 'table' or (reply.err == nil and (keep == nil or keep(reply))) then
    redis.call('SET', record, request_records.pack(reply), 'PX', request_records.ms)
  end
  return reply
end
