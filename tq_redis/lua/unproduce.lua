--[[
  unproduce: mark fields of samples unwritten again, so that a task reading them waits for their
  next put (the dock's rollout claim: a rollout it continues rewrites its response). The bytes
  stay where they are until that put overwrites them; they are not visible meanwhile.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  sample ids as ranges text ("3-7,12", see parse_ranges in includes/bits.lua)
    ARGV[2..]                    field names
  Output:
    {1}                          the fields' bits of those samples are clear
    {-1}                         the partition does not exist
    {-2, id...}                  these ids are not alive; nothing changed
  Touches:
    <p>:meta  <p>:alive  <p>:prod:<field>
]]
-- @include alive
-- @include bits
-- @include prefix

local function unproduce(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local ids = {}
  local ranges = parse_ranges(ARGV[1])
  for i = 1, #ranges do
    for id = ranges[i][1], ranges[i][2] do ids[#ids + 1] = id end
  end
  local refused = missing_reply(prefix, ids)
  if refused then return refused end
  for i = 2, #ARGV do set_ranges(prefix .. 'prod:' .. ARGV[i], ARGV[1], 0) end
  return {1}
end
