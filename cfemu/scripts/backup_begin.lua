-- backup_begin: mark a backup of the structure as running and set its recovery floor.
-- The floor is the lowest LRSN that restore must replay from: the backup's start, or the first LRSN of any UOW
-- holding entries now, whichever is lower. Log-first records below it are refused from now on (floor_check).
-- The stored floor never goes down: a relog pass may have raised it above (relog_begin.lua; refusing more only
-- makes more records re-log, which this backup's replay, from its lower floor, reads all the same).
-- The mark carries a lease ('backup_until', in the CF's time): the backup renews it while it works
-- (backup_renew.lua). A mark whose lease has ended is stale (backup_mark in the prelude): this backup takes its
-- place and names it in its reply. The stale backup's floor stays: the floor never goes down.
-- Refused while the structure runs from a WARM start (header 'started' = WARM, docs/pstore.md): it is empty of the
-- persistent content that its older backups and the logs hold, and a backup of it would become the newest base of
-- the later HOT start, which would then replay the logs only from this backup's floor: every persistent message
-- committed before the CF loss would be lost.
-- ARGV: 1 backup id, 2 caller lrsn, 3 lease (ms)
-- Returns {start lrsn, floor lrsn, the id of the stale mark it replaced ('' when none)}; error BACKUPRUNNING when
-- a backup of this structure is running (its lease not ended), CFSTATE when it is not ACTIVE or runs from a WARM
-- start, BADARG for a lease that is not a positive number of ms.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
if redis.call('HGET', META, 'started') == 'WARM' then
  return redis.error_reply('CFSTATE structure runs from a WARM start: its persistent content is in its older backups '
    .. 'and the logs, not in the CF; start it HOT or COLD (cfemu pstore start) before backing it up')
end
local lease = tonumber(ARGV[3])
if not lease or lease < 1 then return redis.error_reply('BADARG lease must be a positive number of ms') end
local running, stale = backup_mark()
if running then
  local left = tonumber(redis.call('HGET', META, 'backup_until') or '0') - cf_time_ms()
  return redis.error_reply('BACKUPRUNNING backup ' .. running .. ' of this structure is running'
    .. (left > 0 and string.format(' (its lease ends in %.1f s unless it renews it)', left / 1000) or '')
    .. '; cfbackup cancel ends it')
end
local start = tick(ARGV[2])
local floor = start
local all = redis.call('HGETALL', UOWS)
for i = 2, #all, 2 do
  local f = cmsgpack.unpack(all[i]).f
  if f and f < floor then floor = f end
end
local stored = tonumber(redis.call('HGET', META, 'floor') or '0')
redis.call('HSET', META, 'backup', ARGV[1], 'backup_until', string.format('%d', cf_time_ms() + lease),
  'floor', math.max(floor, stored))
return {start, floor, stale or ''}
