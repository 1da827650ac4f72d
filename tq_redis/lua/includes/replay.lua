--[[
  replay: a task may be handed the same sample up to max_times_sampled times (replay, after
  Reverb's max_times_sampled) instead of once. A claim marks its ids consumed as always; then
  count_sampled counts one more time for each and clears the consumed bit again of those handed
  out fewer than `times` times, so a later claim may pick them again. A sample handed out
  `times` times stays consumed and its count is dropped (the consumed bit says it all).

  Offers:
    count_sampled(prefix, task, ids, times)   count a claim's ids; give back those under `times`
  Touches:
    <p>:cons:<task>  <p>:sampled:<task>
]]
-- @include bits
-- @include chunks

local function count_sampled(prefix, task, ids, times)
  if #ids == 0 then return end
  local key = prefix .. 'sampled:' .. task
  local before = hmget_many(key, ids)
  local again, done, hargs = {}, {}, {}
  for i = 1, #ids do
    local k = (tonumber(before[i]) or 0) + 1
    if k < times then
      again[#again + 1] = ids[i]
      hargs[#hargs + 1] = ids[i]
      hargs[#hargs + 1] = k
    else
      done[#done + 1] = ids[i]
    end
  end
  if #again > 0 then
    set_bits(prefix .. 'cons:' .. task, again, 0)
    for from = 1, #hargs, 2 * CHUNK do
      redis.call('HSET', key, unpack(hargs, from, math.min(#hargs, from + 2 * CHUNK - 1)))
    end
  end
  for from = 1, #done, CHUNK do
    redis.call('HDEL', key, unpack(done, from, math.min(#done, from + CHUNK - 1)))
  end
end
