--[[
  set_tags: write per-sample tags (custom meta) of existing samples, and note the change on the
  partition's tag-change stream (kv_watch follows it). A caller that writes tags before the fields
  they describe (a kv_put of both) writes them quietly and notes the change once the fields are
  stored: a call with no tag pair and notify '1' only notes it.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  notify              '1': append the change to <p>:tagchanges; '0': not (yet)
    ARGV[2]  n                   number of sample ids
    ARGV[3..2+n]                 sample ids
    then, repeated:              tag name, then n JSON values ('' = leave unchanged)
  Output:
    {1}                          written (and noted)
    {-1}                         the partition does not exist
    {-2, id...}                  these ids are not alive; nothing written
  Touches:
    <p>:meta  <p>:alive
    <p>:tagnames  <p>:tag:<name>  <p>:tagchanges
]]
-- @include alive
-- @include chunks
-- @include prefix
-- @include tagwatch

local function set_tags(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
  local n = tonumber(ARGV[2])
  local ids = {}
  for i = 1, n do ids[i] = tonumber(ARGV[2 + i]) end
  local refused = missing_reply(prefix, ids)
  if refused then return refused end
  local i = 3 + n
  while i <= #ARGV do
    local name = ARGV[i]
    local key = prefix .. 'tag:' .. name
    local hargs, m = {}, 0
    for j = 1, n do
      local value = ARGV[i + j]
      if value ~= '' then
        hargs[m + 1] = ids[j]; hargs[m + 2] = value
        m = m + 2
        if m >= CHUNK * 2 then redis.call('HSET', key, unpack(hargs, 1, m)); m = 0 end
      end
    end
    if m > 0 then redis.call('HSET', key, unpack(hargs, 1, m)) end
    redis.call('SADD', prefix .. 'tagnames', name)
    i = i + n + 1
  end
  if ARGV[1] == '1' and n > 0 then note_tag_changes(prefix, ids_as_ranges(ids)) end
  return {1}
end
