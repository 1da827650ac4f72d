--[[
  clear: remove samples from the partition. Their bits go first, so no later claim, status or
  get_data check sees them; the ids move to the partition's trash, the client deletes their bytes
  from the stores and then empties the trash (trash_done). Idempotent.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1..]                    sample ids
  Output:
    {cleared_ids, fields, older, rings, freed}
                                 ids that were alive (their data must be deleted), the
                                 partition's registered field names, how many ids were in the
                                 trash before (bytes an earlier delete left behind), the ids
                                 of the rings its store values were put under (their holders),
                                 and the carriers of group-shared values whose last member this
                                 clear removed and whose bytes are in a store (in the trash now,
                                 deleted like the cleared ids'; see includes/shares.lua)
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:sampled:<task>
    <p>:tagnames  <p>:tag:<name>
    <p>:trash  <p>:trashfields  <p>:inline  <p>:rings
    <p>:shared  <p>:share:<field>  <p>:carriers
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
  Flags:
    allow-oom  it only deletes state (and records ids for deletion): clearing must free memory when Redis is full
]]
-- @include bits
-- @include chunks
-- @include events
-- @include inline
-- @include prefix
-- @include shares

local function clear(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local older = redis.call('BITCOUNT', prefix .. 'trash')
  local rings = redis.call('HKEYS', prefix .. 'rings')
  if redis.call('EXISTS', KEYS[1]) == 0 then return {{}, {}, older, rings} end
  local ids = {}
  for i = 1, #ARGV do ids[i] = tonumber(ARGV[i]) end
  local bits = get_bits(prefix .. 'alive', ids)
  local alive = {}
  for i = 1, #ids do
    if bits[i] == 1 then alive[#alive + 1] = ids[i] end
  end
  local fields = redis.call('HKEYS', prefix .. 'fields')
  if #alive == 0 then return {{}, fields, older, rings} end

  set_bits(prefix .. 'alive', alive, 0)
  local freed = {}
  if shares_exist(prefix) then freed = share_unlink(prefix, alive, nil) end
  inline_drop(prefix, alive, fields) -- inline values go with the bits; store bytes via the trash
  set_bits(prefix .. 'trash', alive, 1)
  if #fields > 0 then redis.call('SADD', prefix .. 'trashfields', unpack(fields)) end
  for i = 1, #fields do set_bits(prefix .. 'prod:' .. fields[i], alive, 0) end
  local tasks = redis.call('SMEMBERS', prefix .. 'tasks')
  for i = 1, #tasks do
    set_bits(prefix .. 'cons:' .. tasks[i], alive, 0)
    for from = 1, #alive, CHUNK do
      local part = {unpack(alive, from, math.min(#alive, from + CHUNK - 1))}
      redis.call('ZREM', prefix .. 'lease:' .. tasks[i], unpack(part))
      redis.call('HDEL', prefix .. 'dlv:' .. tasks[i], unpack(part))
      redis.call('HDEL', prefix .. 'sampled:' .. tasks[i], unpack(part))
      redis.call('SREM', prefix .. 'poison:' .. tasks[i], unpack(part))
    end
  end
  local tagnames = redis.call('SMEMBERS', prefix .. 'tagnames')
  for i = 1, #tagnames do
    for from = 1, #alive, CHUNK do
      redis.call('HDEL', prefix .. 'tag:' .. tagnames[i], unpack(alive, from, math.min(#alive, from + CHUNK - 1)))
    end
  end
  redis.call('HINCRBY', KEYS[1], 'samples', -#alive)
  emit(prefix, 'cleared', 'count', #alive)
  return {alive, fields, older, rings, freed}
end
