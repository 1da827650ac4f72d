--[[
  arrival: new samples become alive, with their fields produced, in the script that inserts them
  (insert, group_commit): the bits, the partition's creation time and counters, and the group
  the ids form (the grpo sampler's unit).

  Offers:
    arrive(meta_key, prefix, first, count, names, inline, now_ms)
                                 ids first .. first + count - 1 alive and `names` produced;
                                 inline: whether their values came inline (the partition stays
                                 `inlineonly` while every put was); now_ms: the partition's
                                 creation time if this creates it
  Touches:
    <p>:alive  <p>:prod:<field>  <p>:groups, and the caller's meta_key (the partition meta hash)
]]
-- @include bits

local function arrive(meta_key, prefix, first, count, names, inline, now_ms)
  set_bit_range(prefix .. 'alive', first, count)
  for i = 1, #names do set_bit_range(prefix .. 'prod:' .. names[i], first, count) end
  local created = redis.call('HSETNX', meta_key, 'created_ms', now_ms) == 1
  if not inline then
    redis.call('HDEL', meta_key, 'inlineonly')
  elseif created then
    redis.call('HSET', meta_key, 'inlineonly', 1)
  end
  redis.call('HINCRBY', meta_key, 'samples', count)
  redis.call('HSET', prefix .. 'groups', first, count)
end
