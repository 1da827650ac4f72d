--[[
  wait: register a consumer of a task as waiting for samples, unless the partition changed since
  the claim that found nothing (`claim` registers its caller itself; this serves `claim_ids`). Every later event pushes a token to <prefix>wake:<task> while the
  task has waiters (one token per event, at most one per waiter); the consumer BLPOPs one.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  waiter id           unique per waiting consumer (client and thread)
    ARGV[3]  timeout_ms          how long it will wait at most
    ARGV[4]  last_event_id       what its claim saw (claim's first reply element)
  Output:
    1                            registered: BLPOP <prefix>wake:<task> next
    0                            an event arrived since the claim: claim again at once
  Touches:
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>
]]
-- @include events
-- @include prefix
-- @include waiters

local function wait(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if last_event_id(prefix) ~= ARGV[4] then return 0 end
  register_waiter(prefix, ARGV[1], ARGV[2], tonumber(ARGV[3]))
  return 1
end
