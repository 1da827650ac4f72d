--[[
  alive: which samples exist. Bit i of <p>:alive is set from insert (or kv_resolve) until clear.

  Offers:
    missing_ids(prefix, ids)     the ids whose alive bit is not set (never inserted, or cleared)
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
