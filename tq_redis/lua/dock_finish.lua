--[[
  dock_finish: record which of a dock's rows finished their rollout (a put of `responses` with
  MindSpeed's `rollout_completed`), and hand every unfinished row back to the task that continues
  rollouts: a finished row stays consumed by it (marked if it was not, counted then by its rate
  limiter as mark_consumed counts), an unfinished one is unmarked, so its next claim takes it
  again (a `released` event wakes the task's waiters when a row went back). Rows are the dock's
  user keys (the row number as text); a row without a sample is only recorded.

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name           the task continuing unfinished rollouts ('actor_rollout')
    ARGV[2..]                    pairs of row number, '1' (rollout finished) or '0' (not yet)
  Output:
    {marked, released}           rows newly marked consumed by the task, and rows handed back
  Touches:
    <p>:dockdone  <p>:kv  <p>:tasks  <p>:cons:<task>
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
    <p>:alive  <p>:prod:<field>  <p>:lease:<task> (reading, to check a waiter's need)
]]
-- @include bits
-- @include chunks
-- @include clock
-- @include events
-- @include prefix
-- @include ratelimit

local function dock_finish(KEYS, ARGV)
  local prefix = partition_prefix(KEYS[1])
  local task = ARGV[1]
  local done_key = prefix .. 'dockdone'
  local rows, keys, finished = {}, {}, {}
  for i = 2, #ARGV, 2 do
    local row = tonumber(ARGV[i])
    rows[#rows + 1] = row
    keys[#keys + 1] = tostring(row)
    if ARGV[i + 1] == '1' then finished[#finished + 1] = row end
  end
  if #finished > 0 then set_bits(done_key, finished, 1) end
  local done = get_bits(done_key, rows)
  local sids = hmget_many(prefix .. 'kv', keys)
  local present, state = {}, {}
  for i = 1, #rows do
    if sids[i] then
      present[#present + 1] = tonumber(sids[i])
      state[#state + 1] = done[i]
    end
  end
  if #present == 0 then return {0, 0} end
  local cons = prefix .. 'cons:' .. task
  local before = get_bits(cons, present)
  local mark, back = {}, {}
  for i = 1, #present do
    if state[i] == 1 and before[i] == 0 then mark[#mark + 1] = present[i] end
    if state[i] == 0 and before[i] == 1 then back[#back + 1] = present[i] end
  end
  redis.call('SADD', prefix .. 'tasks', task)
  if #mark > 0 then
    set_id_bits(cons, mark)
    if rl_may_sample(prefix, task, #mark) ~= nil then rl_count_sampled(prefix, task, #mark, server_ms()) end
  end
  if #back > 0 then
    set_bits(cons, back, 0)
    emit(prefix, 'released', 'task', task, 'count', #back)
  end
  return {#mark, #back}
end
