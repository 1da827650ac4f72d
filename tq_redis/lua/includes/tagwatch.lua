--[[
  tagwatch: the partition's tag-change stream, which kv_watch follows instead of polling kv_list.
  Every script that writes tags appends one entry naming the samples it changed; each entry also
  names the entry before it (`prev`), so a reader can tell a cursor whose successors were trimmed
  away (the stream is capped) from one that is simply up to date. A dropped partition leaves one
  `dropped` entry (and the stream expires): whoever follows it must list the partition again.

  Offers:
    TAGCHANGES_CAP               entries kept (about: MAXLEN ~); a cursor older than them expires
    note_tag_changes(prefix, ranges)
                                 append an entry: the ids whose tags changed, as ranges text
                                 ("3-7,12", see parse_ranges in includes/bits.lua)
    ids_as_ranges(ids)           ids (a Lua list) as that text, runs of consecutive ids joined
    mark_tags_dropped(prefix)    the partition was dropped: every cursor expires, the stream goes
    newest_tag_change(prefix)    id of the newest entry ('0-0' when there is none): a cursor "now"
  Touches:
    <p>:tagchanges
]]

local TAGCHANGES_CAP = 10000

local function note_tag_changes(prefix, ranges)
  local key = prefix .. 'tagchanges'
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  local prev = '0-0'
  if #last > 0 then
    prev = last[1][1]
    -- written again after a drop: the stream lives on (its `dropped` entry expires every old cursor)
    if last[1][2][1] == 'dropped' then redis.call('PERSIST', key) end
  end
  redis.call('XADD', key, 'MAXLEN', '~', TAGCHANGES_CAP, '*', 'prev', prev, 'ids', ranges)
end

local function ids_as_ranges(ids)
  local parts, i = {}, 1
  while i <= #ids do
    local j = i
    while j < #ids and ids[j + 1] == ids[j] + 1 do j = j + 1 end
    parts[#parts + 1] = j > i and (ids[i] .. '-' .. ids[j]) or tostring(ids[i])
    i = j + 1
  end
  return table.concat(parts, ',')
end

local function mark_tags_dropped(prefix)
  local key = prefix .. 'tagchanges'
  if redis.call('EXISTS', key) == 0 then return end
  redis.call('XTRIM', key, 'MAXLEN', 0)
  redis.call('XADD', key, '*', 'dropped', '1')
  redis.call('PEXPIRE', key, 60000)
end

local function newest_tag_change(prefix)
  local last = redis.call('XREVRANGE', prefix .. 'tagchanges', '+', '-', 'COUNT', 1)
  if #last == 0 then return '0-0' end
  return last[1][1]
end
