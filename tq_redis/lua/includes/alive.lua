--[[
  alive: which samples exist. Bit i of <p>:alive is set from insert (or kv_resolve) until clear.

  Offers:
    missing_ids(prefix, ids)     the ids whose alive bit is not set (never inserted, or cleared)
    missing_reply(prefix, ids)   nil when every id is alive, else a script's {-2, missing id...} reply
  Touches:
    <p>:alive
]]
-- @include bits

-- Ids among `ids` whose alive bit is not set (never inserted, or cleared).
local function missing_ids(prefix, ids)
  local bits = get_bits(prefix .. 'alive', ids)
  local missing = {}
  for i = 1, #ids do
    if bits[i] == 0 then missing[#missing + 1] = ids[i] end
  end
  return missing
end

-- The reply of a script refused because samples are gone: nil when every id is alive, else
-- {-2, missing id...}.
local function missing_reply(prefix, ids)
  local missing = missing_ids(prefix, ids)
  if #missing == 0 then return nil end
  table.insert(missing, 1, -2)
  return missing
end
