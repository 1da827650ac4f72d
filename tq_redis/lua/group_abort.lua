--[[
  group_abort: give up a reservation (group_reserve): its slots are freed for the staleness bound
  and its ids go to the trash if bytes may have been stored for them (group_extend recorded their
  fields); the client deletes those. Nothing of it was ever visible. Lapsed reservations of the
  partition are freed first.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  token               the reservation
  Output:
    {1, trashed}                 aborted
    {0, trashed}                 no such reservation: committed, aborted, or lapsed and freed already
    trashed: how many reservations (this one included) had their ids put in the trash
  Touches:
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:trash  <p>:trashfields  <p>:ratelimit
]]
-- @include admitwait
-- @include clock
-- @include prefix
-- @include reservations

local function group_abort(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local now = server_ms()
  local trashed, rec = resv_live(prefix, ARGV[1], now)
  if not rec then return {0, trashed} end
  trashed = trashed + resv_free(prefix, ARGV[1], rec)
  admit_wake(prefix, now)
  return {1, trashed}
end
