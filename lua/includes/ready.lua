--[[
  The ready set of a task: alive AND every requested field produced AND NOT consumed by the task.
  Computed into a scratch key of the partition's slot with three BITOPs (no BITOP NOT: its
  result is only as long as the consumed bitmap, which would hide newer samples).
]]

-- Returns the scratch key holding the ready bitmap, or nil if a field is not registered yet.
-- The caller must DEL the key before returning.
local function compute_ready(prefix, task, fields)
  local prods = {}
  if #fields > 0 then
    local schemas = redis.call('HMGET', prefix .. 'fields', unpack(fields))
    for i = 1, #fields do
      if not schemas[i] then return nil end
      prods[i] = prefix .. 'prod:' .. fields[i]
    end
  end
  local ready, overlap = prefix .. 'tmp:ready', prefix .. 'tmp:overlap'
  redis.call('BITOP', 'AND', ready, prefix .. 'alive', unpack(prods))
  redis.call('BITOP', 'AND', overlap, ready, prefix .. 'cons:' .. task)
  redis.call('BITOP', 'XOR', ready, ready, overlap)
  redis.call('DEL', overlap)
  return ready
end

-- Give lapsed leases of a task back: clear their consumed bits so the next claim sees them,
-- or move them to the poison set once they reached max_deliveries (0 = unlimited).
local function release_lapsed(prefix, task, now_ms, max_deliveries)
  local lease = prefix .. 'lease:' .. task
  local lapsed = redis.call('ZRANGEBYSCORE', lease, '-inf', now_ms)
  if #lapsed == 0 then return 0 end
  redis.call('ZREM', lease, unpack(lapsed))
  local release, poison = {}, {}
  if max_deliveries > 0 then
    local counts = redis.call('HMGET', prefix .. 'dlv:' .. task, unpack(lapsed))
    for i = 1, #lapsed do
      if tonumber(counts[i] or 0) >= max_deliveries then
        poison[#poison + 1] = lapsed[i]
      else
        release[#release + 1] = tonumber(lapsed[i])
      end
    end
  else
    for i = 1, #lapsed do release[i] = tonumber(lapsed[i]) end
  end
  if #poison > 0 then redis.call('SADD', prefix .. 'poison:' .. task, unpack(poison)) end
  if #release > 0 then
    set_bits(prefix .. 'cons:' .. task, release, 0)
    emit(prefix, 'released', 'task', task, 'count', #release)
  end
  return #release
end
