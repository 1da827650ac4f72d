--[[
  trash_done: the bytes of these samples are deleted from the stores; take them out of the trash
  (and drop the trash keys once it is empty).

  Input:
    KEYS[1]  partition meta key  <ns>:{<p>}:meta
    ARGV[1]  ids as comma-separated ranges, e.g. "0-1023,2048"
  Output:
    number of ids still in the trash
]]
local function trash_done(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local ranges = parse_ranges(ARGV[1])
  for i = 1, #ranges do
    set_bit_range(prefix .. 'trash', ranges[i][1], ranges[i][2] - ranges[i][1] + 1, 0)
  end
  local left = redis.call('BITCOUNT', prefix .. 'trash')
  if left == 0 then redis.call('DEL', prefix .. 'trash', prefix .. 'trashfields') end
  return left
end
