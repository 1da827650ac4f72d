--[[
  trash_add: record samples whose bytes must be deleted from the stores (a put that failed after
  writing some of them, or a delete that did not finish). The client deletes them and then calls
  trash_done; whatever is left is retried by the next clear of the partition, so no bytes are lost
  to a crash or an unreachable storage node. The ring the bytes were put under joins the
  partition's rings, so that retry deletes them from their holders.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048"
    ARGV[2]  ring                the store's ring the bytes were put under, '' if none
    ARGV[3..]                    field names whose values the ids may have
  Output:
    number of ids now in the partition's trash
  Touches:
    <p>:trash  <p>:trashfields  <p>:rings
  Flags:
    allow-oom  records bytes to delete after a failed put (a put that hit maxmemory, too)
]]
-- @include bits
-- @include placement
-- @include prefix

local function trash_add(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  set_ranges(prefix .. 'trash', ARGV[1], 1)
  if ARGV[2] ~= '' then ring_index(prefix, ARGV[2]) end
  if #ARGV > 2 then redis.call('SADD', prefix .. 'trashfields', unpack(ARGV, 3)) end
  return redis.call('BITCOUNT', prefix .. 'trash')
end
