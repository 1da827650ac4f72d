--[[
  group_extend: keep a reservation (group_reserve) alive and, for a commit about to store the
  group's bytes, make that commit call the reservation's only committer and record the fields it
  stores, so that an abort or a lapse deletes them (no bytes leak when the producer dies between
  storing and committing) and no second commit call of the reservation ever writes its ids'
  bytes. Lapsed reservations of the partition are freed first.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  token               the reservation
    ARGV[2]  lease_ms            new lease from the server's time now; 0 = keep the deadline
    ARGV[3]  committer           '' (a plain extension) or the id of the commit call about to store bytes
    ARGV[4..]                    field names to record (added to those recorded before)
  Output:
    {1, trashed, deadline_ms}    still reserved, until deadline_ms (server time)
    {-6, trashed}                no such reservation: committed, aborted, or lapsed and freed
    {-7, trashed}                another commit call of the reservation is its committer; nothing recorded
    trashed: how many lapsed reservations had their ids put in the trash (the client deletes their bytes)
  Touches:
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:trash  <p>:trashfields  <p>:ratelimit
]]
-- @include clock
-- @include prefix
-- @include reservations

local function group_extend(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local now = server_ms()
  local trashed, rec = resv_live(prefix, ARGV[1], now)
  if not rec then return {-6, trashed} end
  local committer = ARGV[3]
  if committer ~= '' then
    if rec.owner ~= '' and rec.owner ~= committer then return {-7, trashed} end
    rec.owner = committer
  end
  local known = {}
  for i = 1, #rec.fields do known[rec.fields[i]] = true end
  for i = 4, #ARGV do
    if not known[ARGV[i]] then
      rec.fields[#rec.fields + 1] = ARGV[i]
      known[ARGV[i]] = true
    end
  end
  local lease_ms = tonumber(ARGV[2])
  local deadline = lease_ms > 0 and now + lease_ms or tonumber(redis.call('ZSCORE', prefix .. 'resvdl', ARGV[1]))
  resv_put(prefix, ARGV[1], rec, deadline)
  return {1, trashed, deadline}
end
