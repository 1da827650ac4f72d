--[[
  dock_ready: refresh a dock's ready mask from its finished rollouts (MindSpeed's
  `global_ready_mask`): a row is ready when every row of its prompt has finished its rollout.
  Consumers other than the one continuing rollouts claim only ready rows.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  n                   rows per prompt (a prompt's rows are [p*n, (p+1)*n))
    ARGV[2]  rows                the dock's rows
  Output:
    number of prompts whose rows have all finished (<p>:dockready holds exactly their rows)
  Touches:
    <p>:dockdone  <p>:dockready
]]
-- @include bits
-- @include prefix

local function dock_ready(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local n, rows = tonumber(ARGV[1]), tonumber(ARGV[2])
  local all = {}
  for r = 0, rows - 1 do all[r + 1] = r end
  local done = get_bits(prefix .. 'dockdone', all)
  local ready, prompts = {}, 0
  for first = 0, rows - n, n do
    local whole = true
    for r = first, first + n - 1 do
      if done[r + 1] ~= 1 then whole = false; break end
    end
    if whole then
      prompts = prompts + 1
      for r = first, first + n - 1 do ready[#ready + 1] = r end
    end
  end
  local key = prefix .. 'dockready'
  redis.call('DEL', key)
  if #ready > 0 then set_id_bits(key, ready) end
  return prompts
end
