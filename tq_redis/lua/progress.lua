--[[
  progress: what is left of a partition for one task, so a streaming reader can tell "wait for
  more" from "sealed and drained". Writes only scratch keys of the partition's slot.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  nfields
    ARGV[3..2+nfields]           field names the task reads
  Output:
    {last_event_id, exists, sealed, alive, pending, ready}
      last_event_id              stream id to XREAD BLOCK from: any later change emits an event
      exists, sealed             1 or 0
      alive                      samples in the partition
      pending                    alive samples the task has not consumed for good (unclaimed,
                                 or claimed under a lease that is not acknowledged yet)
      ready                      unclaimed samples whose fields are all produced
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>
    <p>:cons:<task>  <p>:lease:<task>
    <p>:tmp:ready  <p>:tmp:overlap  <p>:tmp:progress
    <p>:events
]]
-- @include events
-- @include prefix
-- @include ready

local function progress(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local fields = {}
  for i = 1, tonumber(ARGV[2]) do fields[i] = ARGV[2 + i] end
  local last = last_event_id(prefix)
  if redis.call('EXISTS', KEYS[1]) == 0 then return {last, 0, 0, 0, 0, 0} end
  local sealed = redis.call('HEXISTS', KEYS[1], 'sealed')
  local alive_key = prefix .. 'alive'
  local alive = redis.call('BITCOUNT', alive_key)
  local taken = prefix .. 'tmp:progress'
  redis.call('BITOP', 'AND', taken, alive_key, prefix .. 'cons:' .. task)
  local pending = alive - redis.call('BITCOUNT', taken) + redis.call('ZCARD', prefix .. 'lease:' .. task)
  redis.call('DEL', taken)
  local ready = 0
  local ready_key = compute_ready(prefix, task, fields)
  if ready_key then
    ready = redis.call('BITCOUNT', ready_key)
    redis.call('DEL', ready_key)
  end
  return {last, 1, sealed, alive, pending, ready}
end
