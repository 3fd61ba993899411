-- backup_begin: mark a backup of the structure as running and set its recovery floor.
-- The floor is the lowest LRSN that restore must replay from: the backup's start, or the first LRSN of any UOW
-- holding entries now, whichever is lower. Log-first records below it are refused from now on (floor_check).
-- The stored floor never goes down: a relog pass may have raised it above (relog_begin.lua; refusing more only
-- makes more records re-log, which this backup's replay, from its lower floor, reads all the same).
-- ARGV: 1 backup id, 2 caller lrsn
-- Returns {start lrsn, floor lrsn}; error BACKUPRUNNING when a backup of this structure is already running.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local running = redis.call('HGET', META, 'backup')
if running then return redis.error_reply('BACKUPRUNNING backup ' .. running .. ' of this structure is running') end
local start = tick(ARGV[2])
local floor = start
local all = redis.call('HGETALL', UOWS)
for i = 2, #all, 2 do
  local f = cmsgpack.unpack(all[i]).f
  if f and f < floor then floor = f end
end
local stored = tonumber(redis.call('HGET', META, 'floor') or '0')
redis.call('HSET', META, 'backup', ARGV[1], 'floor', math.max(floor, stored))
return {start, floor}
