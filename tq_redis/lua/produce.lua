--[[
  produce: mark fields of existing samples produced (a rewrite or a later pipeline stage).
  Data first, then bits: the client calls this only after every value is in its store.

  Small values may come inline (see includes/inline.lua): stored in <p>:inline in this same
  atomic step. Values written to a store instead replace any inline value the samples had, and
  the partition is no longer `inlineonly` (see insert.lua), and the ring a store that places keys
  itself put them under is recorded (see includes/placement.lua).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ring                the store's ring the values were put under, '' if none (or inline)
    ARGV[2]  nfields
    ARGV[3..2+2*nfields]         field name, canonical schema JSON pairs
    ARGV[3+2*nfields]            nids
    then                         nids sample ids
    then                         optional: nids x nfields inline values, field-major
  Output:
    {1, freed...}                bits set, `produced` event emitted; freed: carriers of
                                 group-shared values these samples' fields pointed at, whose last
                                 reference this rewrite dropped and whose bytes are in a store (in
                                 the trash now: the caller empties it; see includes/shares.lua)
    {-1}                         the partition does not exist
    {-2, id...}                  these ids are not alive (never inserted or cleared); nothing written
    {0, field, registered}       a field's schema conflicts; nothing written
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:inline  <p>:rings  <p>:loc:<field>
    <p>:shared  <p>:share:<field>  <p>:carriers  <p>:trash  <p>:trashfields
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:cons:<task>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include alive
-- @include bits
-- @include events
-- @include inline
-- @include placement
-- @include prefix
-- @include schemas
-- @include shares

local function produce(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local nfields = tonumber(ARGV[2])
  local pairs_ = {unpack(ARGV, 3, 2 + 2 * nfields)}
  local at = 3 + 2 * nfields
  local nids = tonumber(ARGV[at])
  local ids = {}
  for i = 1, nids do ids[i] = tonumber(ARGV[at + i]) end
  local values_at = at + nids + 1

  local refused = missing_reply(prefix, ids) or schema_refusal(prefix, pairs_)
  if refused then return refused end

  register_schemas(prefix, pairs_)
  local names = {}
  for i = 1, #pairs_, 2 do names[#names + 1] = pairs_[i] end
  if #ARGV >= values_at then
    inline_put(prefix, ids, names, ARGV, values_at)
  else
    inline_drop(prefix, ids, names) -- the store holds the new values: no stale inline copy
    redis.call('HDEL', KEYS[1], 'inlineonly')
    place_ids(prefix, ARGV[1], names, ids)
  end
  -- a rewritten value replaces a group-shared one: the sample stops pointing at its carrier
  local freed = {}
  if shares_exist(prefix) then freed = share_unlink(prefix, ids, names) end
  for i = 1, #names do set_bits(prefix .. 'prod:' .. names[i], ids, 1) end
  emit(prefix, 'produced', 'count', #ids, 'fields', table.concat(names, ','))
  if #freed == 0 then return {1} end
  return {1, unpack(freed)}
end
