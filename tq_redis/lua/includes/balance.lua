--[[
  balance: the Karmarkar-Karp split SeqlenBalancedSampler uses (claim's `balance` sampler).
  Pure Lua over a list of weights: no Redis call.

  Offers:
    kk_partition(weights, k)     k lists of item indexes of equal count and balanced weight
    set_less(a, b), state_first(a, b), state_settle(st)   its orderings
  Touches:
    nothing
]]

--[[
  Karmarkar-Karp largest differencing into k parts with an equal number of items each
  (#weights must be a multiple of k), as the reference SeqlenBalancedSampler does at the group
  level. Ties are broken by a total order, so the result is deterministic:
    a set is ordered by (sum, item count, smallest item); a state's sets are kept largest first
    states are merged largest spread first, then largest first set, then smallest first item.
  Returns k lists of item indexes (1-based, ascending), heaviest part first.
]]
local function set_less(a, b)
  if a.sum ~= b.sum then return a.sum < b.sum end
  if #a.items ~= #b.items then return #a.items < #b.items end
  return a.low < b.low
end

local function state_first(a, b) -- true if state a is merged before state b
  if a.spread ~= b.spread then return a.spread > b.spread end
  local sa, sb = a.sets[1], b.sets[1]
  if set_less(sa, sb) or set_less(sb, sa) then return set_less(sb, sa) end
  return a.low < b.low
end

local function state_settle(st)
  table.sort(st.sets, function(x, y) return set_less(y, x) end)
  st.spread = st.sets[1].sum - st.sets[#st.sets].sum
  local low = st.sets[1].low
  for i = 2, #st.sets do
    if st.sets[i].low < low then low = st.sets[i].low end
  end
  st.low = low
end

local function kk_partition(weights, k)
  local order = {}
  for i = 1, #weights do order[i] = i end
  table.sort(order, function(a, b)
    if weights[a] ~= weights[b] then return weights[a] < weights[b] end
    return a < b
  end)
  local heap = {}
  local function push(st)
    heap[#heap + 1] = st
    local i = #heap
    while i > 1 do
      local p = math.floor(i / 2)
      if state_first(heap[i], heap[p]) then
        heap[i], heap[p] = heap[p], heap[i]
        i = p
      else
        break
      end
    end
  end
  local function pop()
    local top = heap[1]
    heap[1] = heap[#heap]
    heap[#heap] = nil
    local i = 1
    while true do
      local l, r, best = 2 * i, 2 * i + 1, i
      if l <= #heap and state_first(heap[l], heap[best]) then best = l end
      if r <= #heap and state_first(heap[r], heap[best]) then best = r end
      if best == i then break end
      heap[i], heap[best] = heap[best], heap[i]
      i = best
    end
    return top
  end
  for from = 1, #order, k do
    local st = {sets = {}}
    for j = 0, k - 1 do
      local item = order[from + j]
      st.sets[j + 1] = {sum = weights[item], items = {item}, low = item}
    end
    state_settle(st)
    push(st)
  end
  while #heap > 1 do
    local a, b = pop(), pop()
    for i = 1, k do
      local s, t = a.sets[i], b.sets[k + 1 - i]
      for j = 1, #t.items do s.items[#s.items + 1] = t.items[j] end
      s.sum = s.sum + t.sum
      if t.low < s.low then s.low = t.low end
    end
    state_settle(a)
    push(a)
  end
  local parts = {}
  for i = 1, k do
    local items = heap[1].sets[i].items
    table.sort(items)
    parts[i] = items
  end
  return parts
end
