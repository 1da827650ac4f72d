--[[
  channel: RLinf's Channel queues. Every channel script receives KEYS[1] = "<ns>:chan:{<name>}:meta"
  and derives the channel's other keys from its prefix "<ns>:chan:{<name>}:" (written <c>: in the
  Touches sections; one hash slot). A queue entry is the string "<weight>|<payload>", so scripts
  read weights without decoding payloads (no cmsgpack needed).

  Offers:
    channel_prefix(meta_key)     "<ns>:chan:{<name>}:meta" -> "<ns>:chan:{<name>}:"
    stream_last_id(key)          newest id of a stream ("0-0" when empty)
    entry_weight(entry)          the weight of a "<weight>|<payload>" entry
    channel_after_pop(meta, prefix, qkey, wfield, removed_weight)
                                 account for popped entries; a `gets` event if the channel is bounded
  Touches:
    <c>:gets                     (channel_after_pop; the meta and queue keys come from the caller)
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
