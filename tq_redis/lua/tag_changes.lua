--[[
  tag_changes: the samples whose tags changed after a cursor of the partition's tag-change stream
  (what kv_watch returns): the entries after the cursor, in order, until about `budget` sample ids
  are gathered; each changed sample once, if it is still alive and its tags (as they are now)
  match the filter. The client blocks on the stream (XREAD BLOCK from the returned cursor) when
  nothing came, so watching is not polling.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  cursor              a stream id from an earlier reply ('0-0': from the first change),
                                 or '' for "from now" (the newest entry)
    ARGV[2]  budget              sample ids to gather at most (one entry is read whatever its size)
    ARGV[3..]                    optional filter: pairs of tag name, JSON text, as in kv_list
  Output:
    {1, cursor, keys, ids, tags, more}
                                 ids: the alive changed samples whose tags match, in order of
                                 their first change; keys: per id its user key or false (a sample
                                 put without a key); tags = flat {tag name, {JSON value or false
                                 per id}, ...}; cursor: the last entry read (the one given if none,
                                 the newest with ''); more: 1 if entries may follow (budget reached)
    {-1, head}                   the cursor expired: entries after it were trimmed away (the stream
                                 keeps about TAGCHANGES_CAP entries, includes/tagwatch.lua), it is no entry of this stream,
                                 or the partition was dropped since; head is the newest entry now:
                                 list the partition again, then watch from head
  Touches:
    <p>:tagchanges  <p>:alive  <p>:kvkeys  <p>:tagnames  <p>:tag:<name> (all read only)
]]
-- @include bits
-- @include chunks
-- @include prefix
-- @include tags
-- @include tagwatch

local function tag_changes(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local stream = prefix .. 'tagchanges'
  local cursor = ARGV[1]
  if cursor == '' then return {1, newest_tag_change(prefix), {}, {}, {}, 0} end
  local budget = tonumber(ARGV[2])
  local entries = redis.call('XRANGE', stream, '(' .. cursor, '+', 'COUNT', math.min(budget, 512))
  if #entries == 0 then return {1, cursor, {}, {}, {}, 0} end
  local first = entries[1][2]
  if first[1] ~= 'prev' or first[2] ~= cursor then return {-1, newest_tag_change(prefix)} end

  local ids, seen, last, more = {}, {}, cursor, #entries == math.min(budget, 512) and 1 or 0
  for e = 1, #entries do
    local fields = entries[e][2]
    if fields[1] ~= 'prev' then more = 1; break end -- a `dropped` entry: the next call expires
    if #ids >= budget then more = 1; break end
    local ranges = parse_ranges(fields[4])
    for r = 1, #ranges do
      for id = ranges[r][1], ranges[r][2] do
        if not seen[id] then seen[id] = true; ids[#ids + 1] = id end
      end
    end
    last = entries[e][1]
  end

  local keep = get_bits(prefix .. 'alive', ids)
  unmatched_to_zero(prefix, ids, keep, ARGV, 3)
  local live = {}
  for k = 1, #ids do
    if keep[k] == 1 then live[#live + 1] = ids[k] end
  end
  local keys = {}
  if #live > 0 then keys = hmget_many(prefix .. 'kvkeys', live) end
  return {1, last, keys, live, read_tags(prefix, live), more}
end
