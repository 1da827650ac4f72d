--[[
  dock_shape: register the shape of a MindSpeed dock (prompts x samples per prompt) unless it has
  one, and return the shape it has: a process attaching with another shape is refused by its
  client. One step, so two processes creating the same dock with different shapes never mix
  their halves.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  prompts_num
    ARGV[2]  n_samples_per_prompt
  Output:
    {prompts_num, n_samples_per_prompt}    the dock's shape (this call's if it had none)
  Touches:
    <p>:dock
]]
-- @include prefix

local function dock_shape(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local key = prefix .. 'dock'
  redis.call('HSETNX', key, 'prompts_num', ARGV[1])
  redis.call('HSETNX', key, 'n_samples_per_prompt', ARGV[2])
  local got = redis.call('HMGET', key, 'prompts_num', 'n_samples_per_prompt')
  return {tonumber(got[1]), tonumber(got[2])}
end
