-- snapshot: the ids of every entry in one state, across all queues of the structure, taken atomically
-- (a true snapshot: removals by other queue managers cannot shift it, unlike paging a list by index).
-- ARGV: 1 state ('UG' | 'UP' | 'CP' | 'EX')
-- Returns a flat list of entry ids (committed puts in get order per queue).
local lists = {UG = {'ug'}, UP = {'up'}, EX = {'ex'},
  CP = {'cp:9', 'cp:8', 'cp:7', 'cp:6', 'cp:5', 'cp:4', 'cp:3', 'cp:2', 'cp:1', 'cp:0'}}
local which = lists[ARGV[1]]
if not which then return redis.error_reply('BADARG unknown state ' .. ARGV[1]) end
-- The ids are counted as they are added: Lua 5.1's #out searches the table's length at every id, which had been a
-- quarter of the script's time (0.38 against 0.29 us an id, BENCHMARKS.md, backup), with the CF held.
local out, n = {}, 0
for _, queue in ipairs(redis.call('SMEMBERS', QUEUES)) do
  for _, suffix in ipairs(which) do
    for _, id in ipairs(redis.call('LRANGE', qkey(queue, suffix), 0, -1)) do
      n = n + 1
      out[n] = id
    end
  end
end
return out
