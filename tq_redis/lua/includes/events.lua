--[[
  events: the partition's event stream. Every change appends an event (tools and the wrappers
  that follow a partition read it) and wakes waiting consumers; a client that found nothing keeps
  the newest event id and waits from exactly the state it saw.

  Offers:
    last_event_id(prefix)        newest event id of the partition ("0-0" when none)
    emit(prefix, kind, ...)      append an event {type = kind, ...} and wake waiting consumers
    DATA_EVENTS                  the kinds that only add data (a waiter's need decides whether they wake it)
  Touches:
    <p>:events, and through wake_waiters: <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>
    <p>:wakebudget:<task>, and reading to check a waiter's need: <p>:alive  <p>:prod:<field>
    <p>:cons:<task>  <p>:lease:<task>
]]
-- @include waiters

-- Newest event id of the partition's stream ("0-0" when there is none), so a waiting client
-- can XREAD BLOCK from exactly the state this script saw.
local function last_event_id(prefix)
  local last = redis.call('XREVRANGE', prefix .. 'events', '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end

-- Events that only add data: a waiter whose need is known is woken by them once it is met.
-- Every other event (a seal, a clear, released leases, a reset) wakes a waiter regardless.
local DATA_EVENTS = {insert = true, produced = true}

-- Append an event and wake waiting consumers; the stream is capped, it serves tools and the
-- wrappers that follow a partition (dock, streaming) as well.
local function emit(prefix, kind, ...)
  redis.call('XADD', prefix .. 'events', 'MAXLEN', '~', 1000, '*', 'type', kind, ...)
  wake_waiters(prefix, DATA_EVENTS[kind] == true)
end
