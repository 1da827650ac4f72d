--[[
  prefix: every partition script receives KEYS[1] = "<ns>:{<ns>/<p>}:meta" and derives the
  partition's other keys from its prefix "<ns>:{<ns>/<p>}:" (written <p>: in the Touches sections),
  so all keys of one partition share one hash slot. tq_redis/meta/keys.py documents every key.

  Offers:
    partition_prefix(meta_key)   "<ns>:{<ns>/<p>}:meta" -> "<ns>:{<ns>/<p>}:"
  Touches:
    nothing
]]

local function partition_prefix(meta_key)
  return string.sub(meta_key, 1, -5)
end
