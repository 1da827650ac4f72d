--[[
  parts: fields written in parts (partial rollout). A field <f> appended to is registered with
  kind "parts"; part k of a sample is stored as the hidden field "<f>~<k>" (registered, produced,
  inline or in the store, cleared like any field), and two per-sample tags say what is there:
  "<f>~parts" (JSON list of [policy_version, length, k] of the committed parts, in order) and
  "<f>~next" (the next part index; an index is handed out once, so two appenders never share a
  key, and a part whose bytes were stored by a producer that died before recording them is still
  a registered field: a clear deletes it). The sample's <p>:prod:<f> bit is its "complete" mark.

  Offers:
    parts_fields(ARGV, at)               {names, part schemas, main schemas}, next index of ARGV
    parts_completed(prefix, names, ids)  nil, or {field, id...} of ids whose field is complete
    parts_take(prefix, field, ids)       a fresh part index per id (bumps "<f>~next")
    parts_register(prefix, field, part_schema, main_schema, ks)  register <f> and each <f>~<k>
    parts_record(prefix, field, ids, ks, lengths, version)       append [version, length, k] to
                                         each id's "<f>~parts" and set its <f>~<k> bit
    part_name(field, k)                  "<f>~<k>"
  Touches:
    <p>:fields  <p>:prod:<field>  <p>:tagnames  <p>:tag:<name>
]]
-- @include bits
-- @include chunks
-- @include schemas

local function part_name(field, k)
  return field .. '~' .. k
end

local function parts_fields(ARGV, at)
  local n = tonumber(ARGV[at])
  local names, part_schemas, main_schemas = {}, {}, {}
  for i = 1, n do
    local j = at + 3 * (i - 1)
    names[i], part_schemas[i], main_schemas[i] = ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  end
  return {names, part_schemas, main_schemas}, at + 3 * n + 1
end

local function parts_completed(prefix, names, ids)
  for f = 1, #names do
    local bits = get_bits(prefix .. 'prod:' .. names[f], ids)
    local done = {}
    for i = 1, #ids do
      if bits[i] == 1 then done[#done + 1] = ids[i] end
    end
    if #done > 0 then
      table.insert(done, 1, names[f])
      return done
    end
  end
  return nil
end

local function parts_take(prefix, field, ids)
  local key = prefix .. 'tag:' .. field .. '~next'
  local ks = {}
  for i = 1, #ids do
    ks[i] = redis.call('HINCRBY', key, ids[i], 1) - 1
  end
  redis.call('SADD', prefix .. 'tagnames', field .. '~next')
  return ks
end

local function parts_register(prefix, field, part_schema, main_schema, ks)
  local pairs_, seen = {field, main_schema}, {}
  for i = 1, #ks do
    if not seen[ks[i]] then
      seen[ks[i]] = true
      pairs_[#pairs_ + 1] = part_name(field, ks[i])
      pairs_[#pairs_ + 1] = part_schema
    end
  end
  register_schemas(prefix, pairs_)
end

local function parts_record(prefix, field, ids, ks, lengths, version)
  local key = prefix .. 'tag:' .. field .. '~parts'
  local old = hmget_many(key, ids)
  local by_k = {}
  for i = 1, #ids do
    local list = old[i] and cjson.decode(old[i]) or {}
    list[#list + 1] = {version, lengths[i], ks[i]}
    redis.call('HSET', key, ids[i], cjson.encode(list))
    local k = ks[i]
    if not by_k[k] then by_k[k] = {} end
    by_k[k][#by_k[k] + 1] = ids[i]
  end
  for k, kids in pairs(by_k) do set_bits(prefix .. 'prod:' .. part_name(field, k), kids, 1) end
  redis.call('SADD', prefix .. 'tagnames', field .. '~parts')
end
