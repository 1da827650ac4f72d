--[[
  group_commit: make a reserved group (group_reserve) alive, all of it in one atomic step, with
  the fields whose bytes are stored (data first, then bits) or small values inline, the policy
  versions it started and ended on as tags, and the reservation gone. A lapsed, aborted or already
  committed reservation commits nothing: at most one commit of a reservation ever succeeds.
  Lapsed reservations of the partition are freed first.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  token               the reservation
    ARGV[2]  committer           this commit call's id (group_extend made it the committer if
                                 it stored bytes; a reservation with another committer is refused)
    ARGV[3]  end_version         the policy version the group ended on, '' if not given
    ARGV[4]  now_ms              creation time for a new partition
    ARGV[5]  ring                the store's ring the values were put under, '' if none (or inline)
    ARGV[6]  nfields
    ARGV[7..6+2*nfields]         nfields pairs: field name, canonical schema JSON
    ARGV[7+2*nfields..]          optional: count x nfields values kept inline, field-major
  Output:
    {1, trashed, first_id}       the group is alive (tags policy_version = its start version and
                                 policy_version_end = end_version, where given; an `insert` event)
    {-6, trashed}                no such reservation (committed, aborted, or lapsed and freed)
    {-7, trashed}                another commit call is the reservation's committer; nothing written
    {0, field, registered}       a field's schema conflicts; nothing written, still reserved
    {-3, trashed}                the partition is sealed: the reservation is freed
    {-4, trashed}                the partition was sealed and cleared (closed): freed too
    trashed: how many reservations had their ids put in the trash (the client deletes their bytes)
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:inline  <p>:groups  <p>:closed
    <p>:rings  <p>:loc:<field>  <p>:tagnames  <p>:tag:<name> (policy_version, policy_version_end)  <p>:tagchanges
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:trash  <p>:trashfields  <p>:ratelimit
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include admitwait
-- @include arrival
-- @include clock
-- @include events
-- @include inline
-- @include placement
-- @include prefix
-- @include reservations
-- @include schemas
-- @include tags
-- @include tagwatch

local function group_commit(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local token = ARGV[1]
  local now = server_ms()
  local trashed, rec = resv_live(prefix, token, now)
  if not rec then return {-6, trashed} end
  if rec.owner ~= '' and rec.owner ~= ARGV[2] then return {-7, trashed} end
  local refused = nil
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then
    refused = -3
  elseif redis.call('EXISTS', prefix .. 'closed') == 1 then
    refused = -4
  end
  if refused then
    trashed = trashed + resv_free(prefix, token, rec)
    admit_wake(prefix, now)
    return {refused, trashed}
  end
  local nfields = tonumber(ARGV[6])
  local pairs_ = {unpack(ARGV, 7, 6 + 2 * nfields)}
  local refused = schema_refusal(prefix, pairs_)
  if refused then return refused end

  local first, count = rec.first, rec.count
  local names = {}
  for i = 1, #pairs_, 2 do names[#names + 1] = pairs_[i] end
  local values_at = 7 + 2 * nfields
  local inline = #ARGV >= values_at
  if inline then
    local ids = {}
    for i = 1, count do ids[i] = first + i - 1 end
    inline_put(prefix, ids, names, ARGV, values_at)
  else
    place_range(prefix, ARGV[5], names, first, count)
  end
  register_schemas(prefix, pairs_)
  if rec.version ~= '' then tag_range(prefix, 'policy_version', first, count, rec.version) end
  if ARGV[3] ~= '' then tag_range(prefix, 'policy_version_end', first, count, ARGV[3]) end
  if rec.version ~= '' or ARGV[3] ~= '' then note_tag_changes(prefix, first .. '-' .. (first + count - 1)) end
  arrive(KEYS[1], prefix, first, count, names, inline, ARGV[4])
  redis.call('HDEL', prefix .. 'resv', token)
  redis.call('ZREM', prefix .. 'resvdl', token)
  emit(prefix, 'insert', 'first', first, 'count', count, 'fields', table.concat(names, ','))
  return {1, trashed, first}
end
