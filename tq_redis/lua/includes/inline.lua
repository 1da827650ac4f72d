--[[
  inline: small values kept in the metadata plane itself. A put whose every value is at most the
  namespace's `inline_max_bytes` stores them in the HASH <p>:inline (field "<id>:<field>"), in
  the same script that makes the samples visible, so bytes and bits change in one atomic step;
  get_data reads them back together with the visibility check. Larger values live in the stores.

  Offers:
    inline_put(prefix, ids, fields, values, at)  store values[at..] (field-major: every id of the
                                                 first field, then the next field) for ids x fields
    inline_get(prefix, ids, fields, present)     the stored values, field-major, false where none;
                                                 present: whether <p>:inline exists, where the
                                                 caller has asked already (nil: asked here)
    inline_drop(prefix, ids, fields)             forget the values of ids x fields (if any)
    inline_names(ids, fields)                    the HASH fields "<id>:<field>" of ids x fields, field-major
  Touches:
    <p>:inline
]]
-- @include chunks

local function inline_names(ids, fields)
  -- an id is a number: format it once, not once per field (number formatting is most of the cost)
  local heads = {}
  for i = 1, #ids do heads[i] = ids[i] .. ':' end
  local out, n = {}, 0
  for f = 1, #fields do
    local field = fields[f]
    for i = 1, #ids do
      n = n + 1
      out[n] = heads[i] .. field
    end
  end
  return out
end

local function inline_put(prefix, ids, fields, values, at)
  local names = inline_names(ids, fields)
  local args = {}
  for k = 1, #names do
    args[#args + 1] = names[k]
    args[#args + 1] = values[at + k - 1]
    if #args >= 2 * CHUNK then
      redis.call('HSET', prefix .. 'inline', unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('HSET', prefix .. 'inline', unpack(args)) end
end

local function inline_get(prefix, ids, fields, present)
  if present == nil then present = redis.call('EXISTS', prefix .. 'inline') == 1 end
  if not present then return {} end
  return hmget_many(prefix .. 'inline', inline_names(ids, fields))
end

local function inline_drop(prefix, ids, fields)
  if #ids == 0 or #fields == 0 or redis.call('EXISTS', prefix .. 'inline') == 0 then return end
  local names = inline_names(ids, fields)
  for from = 1, #names, CHUNK do
    redis.call('HDEL', prefix .. 'inline', unpack(names, from, math.min(#names, from + CHUNK - 1)))
  end
end
