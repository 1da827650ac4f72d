--[[
  drop_partition: delete every metadata key of a partition except its id counter (so ids stay
  unique if the partition id is used again), its trash and the rings its values were put under:
  the alive samples move to the trash, which the client empties (trash_done) once their bytes are
  deleted from their holders. Group reservations in flight are freed (a commit of one then fails;
  ids of those whose bytes may be stored go to the trash too); the staleness admission
  (<p>:admission: bound, published version, admitted count) stays, like the id counter. A sealed partition stays closed (<p>:closed): a late writer's put
  is refused until reopen_partition. Idempotent.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  now_ms              when it was cleared (recorded in <p>:closed if it was sealed)
  Output:
    {alive_bitmap, fields, older, in_store, rings}
                                 the alive bitmap as it was, the registered field names ({false,
                                 {}} if unknown), how many ids were in the trash before (an earlier
                                 delete's leftovers, and the carriers of group-shared values
                                 with store bytes: includes/shares.lua), and 1 if the samples may have bytes in the
                                 store (the client deletes those), 0 if every value the partition
                                 ever held was inline (`inlineonly`, see insert.lua): the alive
                                 samples then go nowhere, their values went with <p>:inline;
                                 and the ids of the rings its store values were put under
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:sampled:<task>
    <p>:tagnames  <p>:tag:<name>  <p>:groups  <p>:groupidx
    <p>:kv  <p>:kvkeys  <p>:inline
    <p>:trash  <p>:trashfields  <p>:rings  <p>:loc:<field>  <p>:closed
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:resv  <p>:resvdl  <p>:admission  <p>:admitwaiters  <p>:admitwake  <p>:tagchanges  <p>:ratelimit
    <p>:shared  <p>:share:<field>  <p>:carriers  <p>:sharepending
  Flags:
    allow-oom  it only deletes state (and records ids for deletion): clearing must free memory when Redis is full
]]
-- @include admitwait
-- @include chunks
-- @include clock
-- @include events
-- @include prefix
-- @include reservations
-- @include shares
-- @include tagwatch

local function drop_partition(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local reserved = redis.call('HKEYS', prefix .. 'resv')
  for i = 1, #reserved do resv_free(prefix, reserved[i], resv_get(prefix, reserved[i])) end
  redis.call('DEL', prefix .. 'resvdl')
  if #reserved > 0 then admit_wake(prefix, server_ms()) end -- their slots are free
  -- group-shared values (includes/shares.lua): their carriers are not alive samples; those with
  -- store bytes (or pending ones) go to the trash, so `older` counts them and the client empties it
  share_drop(prefix)
  local older = redis.call('BITCOUNT', prefix .. 'trash')
  local rings = redis.call('HKEYS', prefix .. 'rings')
  if redis.call('EXISTS', KEYS[1]) == 0 then return {false, {}, older, 1, rings} end
  if redis.call('HEXISTS', KEYS[1], 'sealed') == 1 then redis.call('SET', prefix .. 'closed', ARGV[1]) end
  local alive = redis.call('GET', prefix .. 'alive')
  local fields = redis.call('HKEYS', prefix .. 'fields')
  local in_store = redis.call('HGET', KEYS[1], 'inlineonly') ~= '1'
  if in_store and alive and redis.call('BITCOUNT', prefix .. 'alive') > 0 then
    redis.call('BITOP', 'OR', prefix .. 'trash', prefix .. 'trash', prefix .. 'alive')
    if #fields > 0 then redis.call('SADD', prefix .. 'trashfields', unpack(fields)) end
  end
  local doomed = {KEYS[1], prefix .. 'alive', prefix .. 'fields', prefix .. 'tasks', prefix .. 'tagnames',
                  prefix .. 'groups', prefix .. 'groupidx', prefix .. 'kv', prefix .. 'kvkeys', prefix .. 'events',
                  prefix .. 'inline'}
  for i = 1, #fields do
    doomed[#doomed + 1] = prefix .. 'prod:' .. fields[i]
    doomed[#doomed + 1] = prefix .. 'loc:' .. fields[i]
  end
  local tasks = redis.call('SMEMBERS', prefix .. 'tasks')
  for i = 1, #tasks do
    doomed[#doomed + 1] = prefix .. 'cons:' .. tasks[i]
    doomed[#doomed + 1] = prefix .. 'lease:' .. tasks[i]
    doomed[#doomed + 1] = prefix .. 'dlv:' .. tasks[i]
    doomed[#doomed + 1] = prefix .. 'poison:' .. tasks[i]
    doomed[#doomed + 1] = prefix .. 'sampled:' .. tasks[i]
  end
  local waiting = redis.call('SMEMBERS', prefix .. 'waittasks')
  for i = 1, #waiting do
    doomed[#doomed + 1] = prefix .. 'waiters:' .. waiting[i]
    doomed[#doomed + 1] = prefix .. 'waitneed:' .. waiting[i]
    doomed[#doomed + 1] = prefix .. 'wake:' .. waiting[i]
    doomed[#doomed + 1] = prefix .. 'wakebudget:' .. waiting[i]
  end
  doomed[#doomed + 1] = prefix .. 'waittasks'
  local tagnames = redis.call('SMEMBERS', prefix .. 'tagnames')
  for i = 1, #tagnames do doomed[#doomed + 1] = prefix .. 'tag:' .. tagnames[i] end
  -- UNLINK: a big value (the inline hash, a tag hash of every sample) is freed in the background,
  -- not while this script holds the server
  for from = 1, #doomed, CHUNK do
    redis.call('UNLINK', unpack(doomed, from, math.min(#doomed, from + CHUNK - 1)))
  end
  -- Readers following the stream re-check and see it gone (its waiters went with the keys above).
  emit(prefix, 'dropped')
  mark_tags_dropped(prefix) -- kv_watch followers learn that they must list the partition again
  redis.call('PEXPIRE', prefix .. 'events', 60000)
  return {alive or false, fields, older, in_store and 1 or 0, rings}
end
