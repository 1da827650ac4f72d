--[[
  claim: hand a task a batch chosen by a built-in sampler from the samples whose requested
  fields are all produced and which the task has not consumed, marking them consumed (or leased)
  in the same atomic step. Lapsed leases of the task are handed back first (no reaper process).
  Never a partial batch: with too few eligible samples nothing is marked and no ids are
  returned -- except with a token budget (max_tokens), where the batch may be smaller.
  Under a rate limiter of the task (rate_limit_config) a claim the limiter holds back finds
  nothing, and one that hands samples out counts them (a rank's stored choice was counted when
  the first rank chose it).
  Cost: O(samples examined + bitmap words skipped), independent of the partition size.

  Samplers (ARGV[5]; see includes/samplers.lua for the selection rules):
    sequential   the first eligible samples in id order
    grpo         whole groups of n (option n)
    rank         RankAwareSampler: the first rank of a DP group to ask for (dp_rank,
                 batch_index) selects and stores its choice under
                 <prefix>rank:<task>:<dp_rank>:<batch_index> (TTL ttl_ms); the group's other
                 ranks get the same ids back without marking anything
    balance      SeqlenBalancedSampler: the first rank to ask for batch_index selects
                 batch_size * dp_size samples in whole groups of n, splits them into dp_size
                 parts of equal group count balanced by total_lengths (Karmarkar-Karp), and
                 stores the parts under <prefix>bal:<task>:<batch_index>; each rank gets part
                 dp_rank

    priority     PrioritizedSampler: drawn without replacement in proportion to the
                 `priority` tag ^ alpha (includes/priority.lua; options alpha, seed)

  Input:
    KEYS[1]  partition meta key  <ns>:{<ns>/<p>}:meta
    ARGV[1]  task name
    ARGV[2]  batch_size          (>= 1; per rank for `balance`)
    ARGV[3]  lease_ms            0 = plain fetch (consumed at once); > 0 = lease for that long,
                                 from the server's time (TIME; no client clock takes part)
    ARGV[4]  max_deliveries      0 = unlimited; a sample delivered this often is put aside
                                 (poison set) instead of being handed out again
    ARGV[5]  sampler             sequential | grpo | rank | balance | priority
    ARGV[6]  nopts, then nopts pairs of option name, value:
               n            group size (grpo, balance; rank optional)      default 1
               max_tokens   token budget by the total_lengths tag          default none
               min_version  only samples with policy_version >= it        default none
               drop_stale   1 = put samples below min_version aside       default 0
               dp_rank, batch_index, dp_size, ttl_ms                     (rank, balance)
               alpha, seed  (priority) the exponent, and the client's random seed
               _values      1 = also return the batch's inline values (get_meta_and_data)
               times        max_times_sampled: a sample is handed to the task up to this
                            many times (replay; fetch mode only) before it stays consumed
                            default 1
    then     nfields, then nfields required field names
    then     optional: waiter id, wait_ms  the caller's waiter id; when nothing is handed out and
                                 wait_ms > 0 it is registered as waiting that long (see `wait`),
                                 with what it needs before new data wakes it (its batch size and
                                 fields; see includes/waiters.lua), otherwise it is removed from
                                 the task's waiters
  Output:
    {last_event_id, ids, schemas, tags, deliveries, next_lapse_ms, registered, inline, values}
                                 (inline and values only with ids; values only with _values)
      last_event_id              what to pass to `wait` when ids is empty ('' otherwise)
    A claim that hands out samples wakes one more waiting consumer of the task, if any, while
    the task has unconsumed samples left (the baton: one wake per event, then one per successful
    claim that leaves something, never every waiter at once).
      ids                        the batch (empty if not enough is ready); ascending, except
                                 that uid groups are kept adjacent
      schemas                    flat {field, schema JSON, ...} of the required fields
      tags                       flat {tag name, {JSON value per id}, ...}
      deliveries                 delivery count per id (lease mode), else empty
      next_lapse_ms              ms until the task's earliest lease lapses on the server's clock
                                 (0: lapsed, handed back by the next claim), -1 if none
      registered                 1 when the waiter was registered (BLPOP <prefix>wake:<task> next)
      inline                     (with ids) 1 when the partition keeps values inline, so get_data
                                 reads them with read_inline first
      values                     (with ids and _values) the batch's values kept inline, read in the
                                 same atomic step as the claim: field-major over ids in the
                                 order of ids, false where a value lives in a store; empty when
                                 the partition keeps nothing inline; false when the partition
                                 has group-shared fields (get_data reads those, see includes/shares.lua)
  Touches:
    <p>:meta  <p>:alive  <p>:fields  <p>:prod:<field>  <p>:tasks
    <p>:cons:<task>  <p>:lease:<task>  <p>:dlv:<task>  <p>:poison:<task>  <p>:sampled:<task>  <p>:counters
    <p>:ratelimit  <p>:admitwaiters  <p>:admitwake
    <p>:tagnames  <p>:tag:<name>  <p>:tag:priority  <p>:groups  <p>:inline  <p>:shared  <p>:groupidx  <p>:rank:<task>:<dp>:<b>  <p>:bal:<task>:<b>
    <p>:events  <p>:waittasks  <p>:waiters:<task>  <p>:waitneed:<task>  <p>:wake:<task>  <p>:wakebudget:<task>
]]
-- @include claiming
-- @include leases
-- @include prefix
-- @include priority
-- @include ready
-- @include replay
-- @include samplers

local function claim(KEYS, ARGV)
  local nopts = tonumber(ARGV[6])
  local opts = {}
  for i = 7, 6 + 2 * nopts, 2 do opts[ARGV[i]] = ARGV[i + 1] end
  local at = 7 + 2 * nopts
  local nfields = tonumber(ARGV[at])
  local prefix = partition_prefix(KEYS[1])
  local c = {
    task = ARGV[1], want = tonumber(ARGV[2]), lease_ms = tonumber(ARGV[3]),
    max_deliveries = tonumber(ARGV[4]), sampler = ARGV[5], opts = opts, fields = {unpack(ARGV, at + 1, at + nfields)},
    waiter = ARGV[at + nfields + 1], wait_ms = tonumber(ARGV[at + nfields + 2] or '0'),
  }
  local task, sampler = c.task, c.sampler
  local _, leased = release_lapsed(prefix, task, c.max_deliveries)
  c.leased = leased

  -- The default sampler without options (a plain fetch, no delivery limit): the first ready
  -- ids, straight from the bitmaps.
  if sampler == 'sequential' and not opts.min_version and not opts.times and (tonumber(opts.max_tokens) or 0) <= 0
      and (c.lease_ms <= 0 or c.max_deliveries <= 0) then
    local ids = {}
    if rate_held(prefix, c, c.want) then return claim_none_ready(prefix, c) end
    if take_ready(prefix, task, c.fields, c.want, ids) < c.want then return claim_none_ready(prefix, c) end
    local deliveries = mark_claimed(prefix, task, ids, c.lease_ms)
    rate_count(prefix, c, ids)
    return claim_reply(prefix, c, ids, deliveries)
  end

  if sampler == 'priority' then
    if rate_held(prefix, c, c.want) then return claim_none_ready(prefix, c) end
    local ids = select_prioritized(prefix, task, c.fields, c.want, tonumber(opts.alpha), tonumber(opts.seed))
    if #ids == 0 then return claim_none_ready(prefix, c) end
    local deliveries = mark_claimed(prefix, task, ids, c.lease_ms)
    if opts.times then count_sampled(prefix, task, ids, tonumber(opts.times)) end
    rate_count(prefix, c, ids)
    return claim_reply(prefix, c, ids, deliveries)
  end

  -- rank / balance: a choice stored by an earlier rank is handed back as it is.
  local cache_key, part = nil, 1
  if sampler == 'rank' then
    cache_key = prefix .. 'rank:' .. task .. ':' .. opts.dp_rank .. ':' .. opts.batch_index
  elseif sampler == 'balance' then
    cache_key = prefix .. 'bal:' .. task .. ':' .. opts.batch_index
    part = tonumber(opts.dp_rank) + 1
  end
  if cache_key then
    local replied = cached_choice(prefix, c, cache_key, part)
    if replied then return replied end
  end

  local total = c.want
  local dp_size = tonumber(opts.dp_size) or 1
  if sampler == 'balance' then total = c.want * dp_size end
  if rate_held(prefix, c, total) then return claim_none_ready(prefix, c) end
  local select_opts = {
    n = tonumber(opts.n) or 1,
    max_tokens = tonumber(opts.max_tokens) or 0,
    min_version = tonumber(opts.min_version),
    drop_stale = opts.drop_stale == '1',
    max_deliveries = (c.lease_ms > 0) and c.max_deliveries or 0,
    weights = sampler == 'balance',
  }
  if sampler == 'sequential' then select_opts.n = 1 end

  local ids, tags = select_units(prefix, task, c.fields, total, select_opts)
  if #ids == 0 then return claim_none_ready(prefix, c) end
  local deliveries = mark_claimed(prefix, task, ids, c.lease_ms)
  if opts.times then count_sampled(prefix, task, ids, tonumber(opts.times)) end
  rate_count(prefix, c, ids)
  local ttl = tonumber(opts.ttl_ms) or 3600000

  if sampler == 'rank' then
    redis.call('SET', cache_key, table.concat(ids, ','), 'PX', ttl)
  elseif sampler == 'balance' then
    return claim_balanced(prefix, c, ids, tags, select_opts.n, dp_size, part, cache_key, ttl)
  end
  return claim_reply(prefix, c, ids, deliveries)
end
