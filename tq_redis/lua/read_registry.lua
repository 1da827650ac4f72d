--[[
  read_registry: the server's clock and every storage node's registration, in one call. Clients
  judge a node's heartbeat by the clock of the server that stored it, and on a Redis Cluster the
  call runs on the node that owns the registry (a pipeline of TIME and HGETALL cannot be routed
  there as one unit).

  Input:
    KEYS[1]  storage-node registry  <ns>:storage:nodes
  Output:
    {seconds, microseconds, {node id, registration JSON, ...}}
      seconds, microseconds      the server's clock (TIME)
      node id, registration      every field of the registry, as HGETALL returns them
  Touches:
    <ns>:storage:nodes
  Flags:
    no-writes  it only reads: it runs on a server that is out of memory too (a clear needs the nodes)
]]

local function read_registry(KEYS, ARGV)
  local t = redis.call('TIME')
  return {t[1], t[2], redis.call('HGETALL', KEYS[1])}
end
