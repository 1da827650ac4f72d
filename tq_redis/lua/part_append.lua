--[[
  part_append: append a part to fields of samples (partial rollout, see includes/parts.lua), and
  optionally mark fields complete, in one atomic step: a reader sees each sample's parts before
  or after the append, never half of it, and a task can claim a sample only once its field is
  marked complete. Small values come inline (stored in <p>:inline here, one round trip: the part
  indexes are handed out here too); values stored in a store come with the indexes part_alloc
  handed out (data first, then bits).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ring                the store's ring the values were put under, '' if none (or inline)
    ARGV[2]  policy version      recorded with each part
    ARGV[3]  ncomplete, then ncomplete field names to mark complete after the append
    then     nfields, then nfields x (field name, part schema JSON, field schema JSON)
    then     nids, then nids sample ids
    then     nfields x nids part lengths (field-major)
    then     mode: 'v' and nfields x nids inline values, or 'k' and nfields x nids part indexes
             from part_alloc (field-major); nothing when nfields is 0
  Output:
    {1}                          appended (and marked); a `produced` event when something was marked
    {-1}                         the partition does not exist
    {-2, id...}                  these ids are not alive; nothing written
    {-3, field, id...}           the field is already complete for these ids; nothing written
    {-4, field}                  a field to mark complete was never appended to; nothing written
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tagnames  <p>:tag:<name>
    <p>:inline  <p>:rings  <p>:loc:<field>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include alive
-- @include bits
-- @include chunks
-- @include events
-- @include parts
-- @include placement
-- @include prefix

local function part_append(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local ring, version = ARGV[1], tonumber(ARGV[2])
  local ncomplete = tonumber(ARGV[3])
  local complete = {unpack(ARGV, 4, 3 + ncomplete)}
  local spec, at = parts_fields(ARGV, 4 + ncomplete)
  local names = spec[1]
  local nids = tonumber(ARGV[at])
  local ids = {}
  for i = 1, nids do ids[i] = tonumber(ARGV[at + i]) end
  at = at + nids + 1
  local refused = missing_reply(prefix, ids)
  if refused then return refused end
  local all = {unpack(names)}
  for i = 1, #complete do all[#all + 1] = complete[i] end
  for i = 1, #complete do
    local schema = redis.call('HGET', prefix .. 'fields', complete[i])
    if not schema or cjson.decode(schema).kind ~= 'parts' then
      local appending = false
      for f = 1, #names do appending = appending or names[f] == complete[i] end
      if not appending then return {-4, complete[i]} end
    end
  end
  local done = parts_completed(prefix, all, ids)
  if done then
    table.insert(done, 1, -3)
    return done
  end
  local lengths_at, mode_at = at, at + #names * nids
  for f = 1, #names do
    local field, base = names[f], (f - 1) * nids
    local lengths = {}
    for i = 1, nids do lengths[i] = tonumber(ARGV[lengths_at + base + i - 1]) end
    local ks = {}
    if ARGV[mode_at] == 'v' then
      ks = parts_take(prefix, field, ids)
      parts_register(prefix, field, spec[2][f], spec[3][f], ks)
      local args = {}
      for i = 1, nids do
        args[#args + 1] = ids[i] .. ':' .. part_name(field, ks[i])
        args[#args + 1] = ARGV[mode_at + base + i]
      end
      for from = 1, #args, 2 * CHUNK do
        redis.call('HSET', prefix .. 'inline', unpack(args, from, math.min(#args, from + 2 * CHUNK - 1)))
      end
    else
      for i = 1, nids do ks[i] = tonumber(ARGV[mode_at + base + i]) end
      local seen = {}
      for i = 1, nids do
        local k = ks[i]
        if not seen[k] then
          seen[k] = {}
        end
        seen[k][#seen[k] + 1] = ids[i]
      end
      for k, kids in pairs(seen) do place_ids(prefix, ring, {part_name(field, k)}, kids) end
    end
    parts_record(prefix, field, ids, ks, lengths, version)
  end
  for i = 1, #complete do set_bits(prefix .. 'prod:' .. complete[i], ids, 1) end
  if #complete > 0 then
    emit(prefix, 'produced', 'count', #ids, 'fields', table.concat(complete, ','))
  end
  return {1}
end
