--[[
  tags: per-sample tags (custom meta). Tag `name` of sample i is the JSON value of field i in the
  HASH <p>:tag:<name>; <p>:tagnames lists the names in use.

  Offers:
    read_tags(prefix, ids)       flat {name1, {JSON value or false per id}, name2, ...}
    tag_range(prefix, name, first, count, value)
                                 tag `name` of ids first .. first + count - 1 set to one JSON value
    unmatched_to_zero(prefix, ids, keep, filter, from)
                                 keep[k] = 0 for each id whose tags differ from the filter: the
                                 (tag name, JSON text) pairs filter[from], filter[from + 1], ...
  Touches:
    <p>:tagnames  <p>:tag:<name>
]]
-- @include chunks

-- Per-sample tags of `ids`: flat {name1, {json...}, name2, {json...}, ...}.
local function read_tags(prefix, ids)
  local out = {}
  if #ids == 0 then return out end
  local names = redis.call('SMEMBERS', prefix .. 'tagnames')
  for i = 1, #names do
    out[#out + 1] = names[i]
    out[#out + 1] = hmget_many(prefix .. 'tag:' .. names[i], ids)
  end
  return out
end

-- Tag `name` of the ids first .. first + count - 1 set to the JSON text `value`.
local function tag_range(prefix, name, first, count, value)
  local key = prefix .. 'tag:' .. name
  for from = 0, count - 1, CHUNK do
    local hargs = {}
    for i = from, math.min(count, from + CHUNK) - 1 do
      hargs[#hargs + 1] = first + i
      hargs[#hargs + 1] = value
    end
    redis.call('HSET', key, unpack(hargs))
  end
  redis.call('SADD', prefix .. 'tagnames', name)
end

-- kv_list's and tag_changes' where=: clear keep[k] of every id whose tag differs from the filter.
local function unmatched_to_zero(prefix, ids, keep, filter, from)
  for i = from, #filter - 1, 2 do
    local values = hmget_many(prefix .. 'tag:' .. filter[i], ids)
    for k = 1, #ids do
      if values[k] ~= filter[i + 1] then keep[k] = 0 end
    end
  end
end
