--[[
  channel: RLinf's Channel queues. Every channel script receives KEYS[1] = "<ns>:chan:{<ns>/<name>}:meta"
  and derives the channel's other keys from its prefix "<ns>:chan:{<ns>/<name>}:" (written <c>: in the
  Touches sections; one hash slot). A queue entry is the string "<weight>|<payload>", so scripts
  read weights without decoding payloads (no cmsgpack needed).

  Offers:
    channel_prefix(meta_key)     "<ns>:chan:{<ns>/<name>}:meta" -> "<ns>:chan:{<ns>/<name>}:"
    stream_last_id(key)          newest id of a stream ("0-0" when empty)
    entry_weight(entry)          the weight of a "<weight>|<payload>" entry
    channel_queue(meta, prefix, key)
                                 the queue key and weight field of queue `key`; nil if the channel is gone
    channel_scan(meta, qkey, wfield, target, visit)
                                 walk the queue from its head, handing `visit` each entry and its
                                 weight until it says stop (true), to its end (false), or not at
                                 all: the queue is too light (nil)
    channel_after_pop(meta, prefix, qkey, wfield, removed_weight)
                                 account for popped entries; a `gets` event if the channel is bounded
  Touches:
    <c>:q:<key>                  (channel_queue names it, channel_scan reads it)
    <c>:gets                     (channel_after_pop; the meta key comes from the caller)
]]

local function channel_prefix(meta_key)
  return string.sub(meta_key, 1, -5)
end

-- Newest id of a stream ("0-0" when empty): a blocked client XREADs from exactly this state.
local function stream_last_id(key)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end

local function entry_weight(entry)
  local bar = string.find(entry, '|', 1, true)
  return tonumber(string.sub(entry, 1, bar - 1))
end

-- Queue `key` of the channel: its list key and the meta field summing its weights; nil when the
-- channel does not exist (its meta hash is gone).
local function channel_queue(meta, prefix, key)
  if redis.call('EXISTS', meta) == 0 then return nil end
  return prefix .. 'q:' .. key, 'w:' .. key
end

-- Walk queue `qkey` from its head in chunks, calling visit(entry, weight) until it returns true:
-- true then, false when the queue ran out first, nil (nothing walked) when the queue's running
-- weight sum (field `wfield`) shows it weighs less than `target` altogether. The sum is a hint,
-- the walk is the truth.
local function channel_scan(meta, qkey, wfield, target, visit)
  if tonumber(redis.call('HGET', meta, wfield) or 0) < target - 1e-9 then return nil end
  local from = 0
  while true do
    local chunk = redis.call('LRANGE', qkey, from, from + 127)
    if #chunk == 0 then return false end
    for i = 1, #chunk do
      if visit(chunk[i], entry_weight(chunk[i])) then return true end
    end
    from = from + #chunk
  end
end

-- Account for entries leaving queue `qkey` (field `wfield` of the meta hash sums its weights);
-- an emptied queue resets the sum, so float rounding never accumulates.
local function channel_after_pop(meta, prefix, qkey, wfield, removed_weight)
  if redis.call('LLEN', qkey) == 0 then
    redis.call('HDEL', meta, wfield)
  else
    redis.call('HINCRBYFLOAT', meta, wfield, -removed_weight)
  end
  if tonumber(redis.call('HGET', meta, 'maxsize') or 0) > 0 then
    redis.call('XADD', prefix .. 'gets', 'MAXLEN', '~', 1000, '*', 'key', string.sub(wfield, 3))
  end
end
