--[[
  kv_list: one page of the user keys of a partition whose sample is alive, with their sample ids
  and tags. Pages follow an HSCAN cursor over <p>:kv, so listing a partition of many keys never
  holds the server for long; like HSCAN, a key present throughout is listed at least once (a
  caller that pages may see one twice).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  cursor              '0' for the first page
    ARGV[2]  count               keys to scan for this page (a hint, as HSCAN's COUNT)
    ARGV[3..]                    optional filter: pairs of tag name, JSON text; only keys whose
                                 tag of each name has exactly that JSON text are listed
  Output:
    {next_cursor, keys, ids, tags}
                                 next_cursor '0' when this was the last page; tags = flat {tag name,
                                 {JSON value or false per key}, ...}; {'0', {}, {}, {}} if the
                                 partition does not exist
  Touches:
    <p>:meta  <p>:alive
    <p>:tagnames  <p>:tag:<name>
    <p>:kv
]]
-- @include bits
-- @include prefix
-- @include tags

local function kv_list(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  if redis.call('EXISTS', KEYS[1]) == 0 then return {'0', {}, {}, {}} end
  local page = redis.call('HSCAN', prefix .. 'kv', ARGV[1], 'COUNT', ARGV[2])
  local flat = page[2]
  local keys, ids = {}, {}
  for i = 1, #flat, 2 do
    keys[#keys + 1] = flat[i]
    ids[#ids + 1] = tonumber(flat[i + 1])
  end
  local alive = get_bits(prefix .. 'alive', ids)
  unmatched_to_zero(prefix, ids, alive, ARGV, 3)
  local live_keys, live_ids = {}, {}
  for i = 1, #ids do
    if alive[i] == 1 then
      live_keys[#live_keys + 1] = keys[i]
      live_ids[#live_ids + 1] = ids[i]
    end
  end
  return {page[1], live_keys, live_ids, read_tags(prefix, live_ids)}
end
