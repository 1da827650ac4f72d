--[[
  trash_done: the bytes of these samples are deleted from the stores; take them out of the trash
  (and drop the trash keys once it is empty, and the partition's rings too once the partition is
  gone: no bytes of it are left to find).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048"
  Output:
    number of ids still in the trash
  Touches:
    <p>:meta  <p>:trash  <p>:trashfields  <p>:rings
  Flags:
    allow-oom  it only deletes: emptying the trash must work when Redis is full
]]
-- @include bits
-- @include prefix

local function trash_done(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  set_ranges(prefix .. 'trash', ARGV[1], 0)
  local left = redis.call('BITCOUNT', prefix .. 'trash')
  if left == 0 then
    redis.call('DEL', prefix .. 'trash', prefix .. 'trashfields')
    if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', prefix .. 'rings') end
  end
  return left
end
