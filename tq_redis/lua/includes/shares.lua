--[[
  shares: group-shared field values. One value of a field put for a whole group of samples is
  stored once, under a *carrier* id: a fresh id from the partition's counter that never becomes a
  sample (never alive, never claimable), so its store key, its inline entry "<carrier>:<field>"
  and its placement (loc:<field>) are those of an ordinary value and the trash deletes it like one.

  <p>:shared            SET of the field names some sample shares (absent: no sharing, and the
                        scripts that check it do nothing more)
  <p>:share:<field>     HASH member id -> carrier id
  <p>:carriers          HASH carrier id -> references (members x fields pointing at it);
                        "<carrier>:s" -> 1 when its values are in a store (not inline)
  <p>:sharepending      bitmap of carriers allocated by share_begin whose store bytes may be
                        written but not linked yet (a writer killed there leaves them for
                        drop_partition, which moves them to the trash)

  A carrier's references drop when a member is cleared or its field rewritten; at 0 the carrier
  goes: its inline values with it, its store bytes to the trash (the caller deletes them).

  Offers:
    shares_exist(prefix)                    whether any field of the partition is shared
    share_unlink(prefix, ids, fields)       forget the shares of ids x fields (fields: nil = every
                                            shared field); returns the freed carriers whose bytes
                                            are in a store, now in the trash
    share_refs(prefix, ids, fields)         field-major carrier id of ids x fields, false where none
    share_values(prefix, ids, fields, values)
                                            read_inline's reply for ids x fields given their own
                                            inline values: members get the carrier's inline value;
                                            {0, values} or {0, values, refs, carriers, placement}
    share_drop(prefix)                      drop_partition's part: stored and pending carriers to
                                            the trash, every share key deleted
  Touches:
    <p>:shared  <p>:share:<field>  <p>:carriers  <p>:sharepending  <p>:inline  <p>:trash  <p>:trashfields
    <p>:rings  <p>:loc:<field>
]]
-- @include bits
-- @include chunks
-- @include inline
-- @include placement

local function shares_exist(prefix)
  return redis.call('EXISTS', prefix .. 'shared') == 1
end

local function share_unlink(prefix, ids, fields)
  local shared = redis.call('SMEMBERS', prefix .. 'shared')
  local wanted = {}
  if fields then for i = 1, #fields do wanted[fields[i]] = true end end
  local drops, order = {}, {}
  for f = 1, #shared do
    local field = shared[f]
    if (not fields or wanted[field]) and #ids > 0 then
      local key = prefix .. 'share:' .. field
      local carriers = hmget_many(key, ids)
      for from = 1, #ids, CHUNK do
        redis.call('HDEL', key, unpack(ids, from, math.min(#ids, from + CHUNK - 1)))
      end
      for i = 1, #carriers do
        local c = carriers[i]
        if c then
          if not drops[c] then
            drops[c] = 0
            order[#order + 1] = c
          end
          drops[c] = drops[c] + 1
        end
      end
      if redis.call('EXISTS', key) == 0 then redis.call('SREM', prefix .. 'shared', field) end
    end
  end
  local freed = {}
  for i = 1, #order do
    local c = order[i]
    if redis.call('HINCRBY', prefix .. 'carriers', c, -drops[c]) <= 0 then
      local stored = redis.call('HGET', prefix .. 'carriers', c .. ':s')
      redis.call('HDEL', prefix .. 'carriers', c, c .. ':s')
      inline_drop(prefix, {tonumber(c)}, shared)
      if stored then freed[#freed + 1] = tonumber(c) end
    end
  end
  if #freed > 0 then
    set_bits(prefix .. 'trash', freed, 1)
    redis.call('SADD', prefix .. 'trashfields', unpack(shared))
  end
  return freed
end

local function share_refs(prefix, ids, fields)
  local out, n = {}, 0
  for f = 1, #fields do
    local key = prefix .. 'share:' .. fields[f]
    local got = {}
    if redis.call('EXISTS', key) == 1 then got = hmget_many(key, ids) end
    for i = 1, #ids do
      n = n + 1
      out[n] = got[i] or false
    end
  end
  return out
end

-- drop_partition: every carrier whose bytes are (or may be, pending) in a store goes to the
-- trash, and the share keys go.
local function share_drop(prefix)
  local shared = redis.call('SMEMBERS', prefix .. 'shared')
  local flat = redis.call('HKEYS', prefix .. 'carriers')
  local stored = {}
  for i = 1, #flat do
    local c = string.match(flat[i], '^(%d+):s$')
    if c then stored[#stored + 1] = tonumber(c) end
  end
  if #stored > 0 then set_bits(prefix .. 'trash', stored, 1) end
  if #shared > 0 then redis.call('SADD', prefix .. 'trashfields', unpack(shared)) end
  if redis.call('EXISTS', prefix .. 'sharepending') == 1 then
    redis.call('BITOP', 'OR', prefix .. 'trash', prefix .. 'trash', prefix .. 'sharepending')
  end
  local doomed = {prefix .. 'shared', prefix .. 'carriers', prefix .. 'sharepending'}
  for i = 1, #shared do doomed[#doomed + 1] = prefix .. 'share:' .. shared[i] end
  redis.call('DEL', unpack(doomed))
end

-- read_inline's part: members' values of shared fields are their carrier's inline value, or
-- (store values) the carrier's id in refs, with the carriers and their placement.
local function share_values(prefix, ids, fields, values)
  local refs = share_refs(prefix, ids, fields)
  if #values == 0 then
    for k = 1, #refs do values[k] = false end
  end
  local seen, carriers, cached = {}, {}, {}
  for k = 1, #refs do
    local c = refs[k]
    if c then
      local name = c .. ':' .. fields[math.floor((k - 1) / #ids) + 1]
      local v = cached[name]
      if v == nil then
        v = redis.call('HGET', prefix .. 'inline', name)
        cached[name] = v
      end
      if v then
        values[k] = v
        refs[k] = false
      elseif not seen[c] then
        seen[c] = true
        carriers[#carriers + 1] = tonumber(c)
      end
    end
  end
  if #carriers == 0 then return {0, values} end
  table.sort(carriers)
  local ranges = {}
  for i = 1, #carriers do ranges[i] = {carriers[i], carriers[i]} end
  return {0, values, refs, carriers, placement(prefix, ranges, fields)}
end
