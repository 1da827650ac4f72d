--[[
  schemas: the field schemas of a partition (the `fields` HASH). A client offers each field's
  schema as canonical JSON ({"dtype","kind","shape"}, keys sorted). By default a field whose shape
  or dtype varies between puts is widened, as the reference system does: tensor kinds become one
  jagged (or strided) field, numpy arrays an ndarray field of any shape, anything else "mixed";
  every value carries its own header, so reads rebuild it exactly. A schema offered with a leading
  '!' is strict: it must equal the registered one.

  Offers:
    schema_conflict(prefix, fields_and_schemas)   nil, or {field, registered} of a strict mismatch
    schema_refusal(prefix, fields_and_schemas)    nil, or a script's {0, field, registered} reply
    register_schemas(prefix, fields_and_schemas)  register (or widen) each field's schema
    read_schemas(prefix, fields)                  flat {field, schema JSON or false, ...}
    widen_schema(registered, offered), strict_schema(offered), and their parts TENSOR_KINDS,
    json_or_nil(value), schema_text(dtype, kind), dtype_family(dtype)
  Touches:
    <p>:fields
]]

local TENSOR_KINDS = {tensor = true, jagged = true, strided = true}

local function json_or_nil(value)
  if value == nil or value == cjson.null then return nil end
  return value
end

local function schema_text(dtype, kind)
  local d = dtype and ('"' .. dtype .. '"') or 'null'
  return '{"dtype":' .. d .. ',"kind":"' .. kind .. '","shape":null}'
end

-- Numpy byte/unicode strings of different lengths share a dtype family ("<U5", "<U7" -> "<U").
local function dtype_family(dtype)
  if dtype and (string.sub(dtype, 2, 2) == 'S' or string.sub(dtype, 2, 2) == 'U') then
    return string.sub(dtype, 1, 2)
  end
  return dtype
end

local function widen_schema(registered, offered)
  local r, o = cjson.decode(registered), cjson.decode(offered)
  local rd, od = json_or_nil(r.dtype), json_or_nil(o.dtype)
  if TENSOR_KINDS[r.kind] and TENSOR_KINDS[o.kind] then
    local kind = (r.kind == 'strided' or o.kind == 'strided') and 'strided' or 'jagged'
    return schema_text(rd == od and rd or 'mixed', kind)
  end
  if r.kind == 'ndarray' and o.kind == 'ndarray' then
    local rf, of = dtype_family(rd), dtype_family(od)
    return schema_text(rf == of and rf or 'mixed', 'ndarray')
  end
  if r.kind == 'object' and o.kind == 'object' then return registered end
  return schema_text(nil, 'mixed')
end

local function strict_schema(offered)
  if string.sub(offered, 1, 1) == '!' then return true, string.sub(offered, 2) end
  return false, offered
end

-- Returns nil when no strict schema differs from its registered one, else {field, registered}.
local function schema_conflict(prefix, fields_and_schemas)
  for i = 1, #fields_and_schemas, 2 do
    local strict, offered = strict_schema(fields_and_schemas[i + 1])
    if strict then
      local registered = redis.call('HGET', prefix .. 'fields', fields_and_schemas[i])
      if registered and registered ~= offered then
        return {fields_and_schemas[i], registered}
      end
    end
  end
  return nil
end

-- The reply of a script refused by a schema conflict: nil, or {0, field, registered}.
local function schema_refusal(prefix, fields_and_schemas)
  local conflict = schema_conflict(prefix, fields_and_schemas)
  if conflict then return {0, conflict[1], conflict[2]} end
  return nil
end

-- Register each field's schema, widening one that differs from what is registered.
local function register_schemas(prefix, fields_and_schemas)
  local key = prefix .. 'fields'
  for i = 1, #fields_and_schemas, 2 do
    local _, offered = strict_schema(fields_and_schemas[i + 1])
    local registered = redis.call('HGET', key, fields_and_schemas[i])
    if not registered then
      redis.call('HSET', key, fields_and_schemas[i], offered)
    elseif registered ~= offered then
      local widened = widen_schema(registered, offered)
      if widened ~= registered then redis.call('HSET', key, fields_and_schemas[i], widened) end
    end
  end
end

-- Flat {field1, schema1, ...} of the requested fields (false where unknown).
local function read_schemas(prefix, fields)
  local out = {}
  if #fields == 0 then return out end
  local schemas = redis.call('HMGET', prefix .. 'fields', unpack(fields))
  for i = 1, #fields do
    out[#out + 1] = fields[i]
    out[#out + 1] = schemas[i]
  end
  return out
end
