--[[
  dock_resort: re-sort a dock's rows after a partial-rollout clear (MindSpeed's oldest prompts
  first). No bytes move: each row's user key (the row number as text) is mapped to the sample of
  the row it takes, that sample's `dock_index` and `uid` tags are rewritten (a change kv_watch
  reports), and the dock's finished / ready bitmaps and ages are replaced by the re-sorted ones.
  The client computes the order from the ages it read; a clear runs while no other process uses
  the dock, as in MindSpeed. One call carries every row of the dock (a dock clears once a step).

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  n                   rows per prompt (`uid` of row r: floor(r / n))
    ARGV[2]  rows                the dock's rows
    ARGV[3]  finished            one '0'/'1' per row, in the new order (<p>:dockdone)
    ARGV[4]  ready               one '0'/'1' per row, in the new order (<p>:dockready)
    ARGV[5..4+rows]              the row each row takes its sample from (itself: unmoved)
    then     rows ages, in the new order (0: none)
  Output:
    number of samples that moved to another row
  Touches:
    <p>:kv  <p>:kvkeys  <p>:tagnames  <p>:tag:<name>  <p>:tagchanges
    <p>:dockdone  <p>:dockready  <p>:dockage
]]
-- @include bits
-- @include chunks
-- @include prefix
-- @include tagwatch

local function dock_resort(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local n, rows = tonumber(ARGV[1]), tonumber(ARGV[2])
  local keys = {}
  for r = 0, rows - 1 do keys[r + 1] = tostring(r) end
  local sids = hmget_many(prefix .. 'kv', keys)
  local empty, moved = {}, {}
  local kv_args, key_args, index_args, uid_args = {}, {}, {}, {}
  local function flush(key, args)
    if #args > 0 then redis.call('HSET', key, unpack(args)) end
    return {}
  end
  for r = 0, rows - 1 do
    local from = tonumber(ARGV[5 + r])
    if from ~= r then
      local sid = sids[from + 1]
      if sid then
        moved[#moved + 1] = tonumber(sid)
        kv_args[#kv_args + 1] = keys[r + 1]; kv_args[#kv_args + 1] = sid
        key_args[#key_args + 1] = sid; key_args[#key_args + 1] = keys[r + 1]
        index_args[#index_args + 1] = sid; index_args[#index_args + 1] = keys[r + 1]
        uid_args[#uid_args + 1] = sid; uid_args[#uid_args + 1] = tostring(math.floor(r / n))
        if #kv_args >= 2 * CHUNK then
          kv_args, key_args = flush(prefix .. 'kv', kv_args), flush(prefix .. 'kvkeys', key_args)
          index_args, uid_args = flush(prefix .. 'tag:dock_index', index_args), flush(prefix .. 'tag:uid', uid_args)
        end
      else
        empty[#empty + 1] = keys[r + 1]
      end
    end
  end
  flush(prefix .. 'kv', kv_args)
  flush(prefix .. 'kvkeys', key_args)
  flush(prefix .. 'tag:dock_index', index_args)
  flush(prefix .. 'tag:uid', uid_args)
  for from = 1, #empty, CHUNK do
    redis.call('HDEL', prefix .. 'kv', unpack(empty, from, math.min(#empty, from + CHUNK - 1)))
  end
  if #moved > 0 then
    redis.call('SADD', prefix .. 'tagnames', 'dock_index', 'uid')
    table.sort(moved)
    note_tag_changes(prefix, ids_as_ranges(moved))
  end

  local function replace_bits(key, flags)
    local ones = {}
    for r = 1, rows do
      if string.sub(flags, r, r) == '1' then ones[#ones + 1] = r - 1 end
    end
    redis.call('DEL', key)
    if #ones > 0 then set_id_bits(key, ones) end
  end
  replace_bits(prefix .. 'dockdone', ARGV[3])
  replace_bits(prefix .. 'dockready', ARGV[4])
  local age_key, ages = prefix .. 'dockage', {}
  redis.call('DEL', age_key)
  for r = 0, rows - 1 do
    local age = ARGV[5 + rows + r]
    if age ~= '0' then
      ages[#ages + 1] = r; ages[#ages + 1] = age
      if #ages >= 2 * CHUNK then ages = flush(age_key, ages) end
    end
  end
  flush(age_key, ages)
  return #moved
end
