-- queue_mark: a short mark of a queue's committed entries that changes whenever one is made available on it (a
-- commit's put, a backed-out get) or taken from it (a get, an expiry): for each priority list that holds any, its
-- priority, length, first and last entry id. A waiting receive reads it between its looks at a service's control
-- entries (sqm.conversations.receive_watch) and looks again only when it changed: one cheap call, whatever the queue
-- holds. A change that leaves every list's length and both ends as they were (an entry made available inside a list
-- while another inside it is taken) does not show; its reader looks again on a timer too.
-- Read only; idempotent.
-- ARGV: 1 queue
-- Returns the mark (a string; equal marks: nothing seen to change).
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue = ARGV[1]
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
local parts = {}
for p = 0, 9 do
  local k = qkey(queue, 'cp:' .. p)
  local n = redis.call('LLEN', k)
  if n > 0 then
    parts[#parts + 1] = p .. ':' .. n .. ':' .. redis.call('LINDEX', k, 0) .. ':' .. redis.call('LINDEX', k, -1)
  end
end
return table.concat(parts, ' ')
