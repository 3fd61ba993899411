-- pclock: read and advance the structure's pseudo-clock, the clock UOW lifetimes count on (EntireX: a UOW lifetime
-- runs only while the system is up). It advances by the CF's own time (Redis TIME: no member's skew counts) since
-- the last tick, but only when that gap is at most ARGV[1]: members tick it every second or so while the group is
-- up, so a longer gap is downtime (the group, or this structure, was down) and adds nothing. A restored structure
-- comes back without its clock: ARGV[2] raises it to at least the newest stamp its restored statuses carry. Ticks
-- only while the structure is ACTIVE (no timeout processing while the store is unavailable); a tick refused for
-- another state writes only that the next tick must not count the time since the last. While its persistent store is
-- disconnected (pstore.lua) the clock stands still: it is read, and the tick only moves the CF time it counts from,
-- so that neither the disconnected time nor a lifetime passes.
-- Idempotent in the sense that matters: two members ticking at once add the elapsed time once.
-- ARGV: 1 the longest gap counted as up-time (ms), 2 floor (ms; 0 = none)
-- Returns {the clock (ms of up-time), the CF's time (ms since the epoch): one clock for the whole group where an
-- order must not follow a member's wall clock (a user's LAST unit of work)}.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then
  -- The time it is not ACTIVE is not up-time: the next tick starts counting afresh (a short RECOVERING was counted
  -- whole at the first tick after it, and a UOW timed out the moment its structure came back).
  if redis.call('EXISTS', PREFIX .. 'pclock') == 1 then redis.call('HSET', PREFIX .. 'pclock', 'w', '0') end
  return redis.error_reply('CFSTATE structure is ' .. st)
end
local gap, floor = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local k = PREFIX .. 'pclock'
local v = tonumber(redis.call('HGET', k, 'v') or '0')
local last = tonumber(redis.call('HGET', k, 'w') or '0')
if last > 0 and now > last and now - last <= gap and not disconnected() then v = v + (now - last) end
if floor > v then v = floor end
redis.call('HSET', k, 'v', string.format('%d', v), 'w', string.format('%d', now))
return {v, now}
