--[[
  claim: hand a task `batch_size` samples whose requested fields are all produced and which the
  task has not consumed, marking them consumed (or leased) in the same atomic step.
  Never a partial batch: with fewer ready samples nothing is marked and no ids are returned.
  Lapsed leases of the task are handed back first (no reaper process).

  Input:
    KEYS[1]  partition meta key  <ns>:{<p>}:meta
    ARGV[1]  task name
    ARGV[2]  batch_size          (>= 1)
    ARGV[3]  now_ms              client clock, used for lease deadlines
    ARGV[4]  lease_ms            0 = plain fetch (consumed at once); > 0 = lease for that long
    ARGV[5]  max_deliveries      0 = unlimited; lapsed samples delivered this often go to poison
    ARGV[6]  nfields
    ARGV[7..6+nfields]           required field names
  Output:
    {last_event_id, ids, schemas, tags, deliveries, next_deadline_ms}
      last_event_id              stream id to XREAD BLOCK from when ids is empty
      ids                        claimed sample ids, ascending (empty if not enough are ready)
      schemas                    flat {field, schema JSON, ...} of the required fields
      tags                       flat {tag name, {JSON value per id}, ...}
      deliveries                 delivery count per id (lease mode), else empty
      next_deadline_ms           earliest lease deadline of the task, -1 if none
]]
local function claim(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task, want = ARGV[1], tonumber(ARGV[2])
  local now_ms, lease_ms = tonumber(ARGV[3]), tonumber(ARGV[4])
  local max_deliveries = tonumber(ARGV[5])
  local fields = {unpack(ARGV, 7, 6 + tonumber(ARGV[6]))}
  local lease = prefix .. 'lease:' .. task

  local function next_deadline()
    local first = redis.call('ZRANGE', lease, 0, 0, 'WITHSCORES')
    if #first == 0 then return -1 end
    return tonumber(first[2])
  end

  if redis.call('EXISTS', KEYS[1]) == 0 then
    return {last_event_id(prefix), {}, {}, {}, {}, -1}
  end
  redis.call('SADD', prefix .. 'tasks', task)
  release_lapsed(prefix, task, now_ms, max_deliveries)

  local ids = {}
  local ready = compute_ready(prefix, task, fields)
  if ready then
    if redis.call('BITCOUNT', ready) >= want then ids = first_set_bits(ready, want) end
    redis.call('DEL', ready)
  end
  if #ids == 0 then
    return {last_event_id(prefix), {}, read_schemas(prefix, fields), {}, {}, next_deadline()}
  end

  set_bits(prefix .. 'cons:' .. task, ids, 1)
  local deliveries = {}
  if lease_ms > 0 then
    local deadline = now_ms + lease_ms
    local zargs = {}
    for i = 1, #ids do
      zargs[2 * i - 1] = deadline
      zargs[2 * i] = ids[i]
      deliveries[i] = redis.call('HINCRBY', prefix .. 'dlv:' .. task, ids[i], 1)
    end
    redis.call('ZADD', lease, unpack(zargs))
  end
  return {last_event_id(prefix), ids, read_schemas(prefix, fields), read_tags(prefix, ids), deliveries,
          next_deadline()}
end
