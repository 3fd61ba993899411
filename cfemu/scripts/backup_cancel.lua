-- backup_cancel: an operator ends the structure's backup mark, running or stale (cfbackup cancel). The backup it
-- belonged to, if it still runs, is refused at its next renewal or at its end (backup_renew.lua, backup_end.lua)
-- and fails; no good backup comes of it. The floor is left as it is (it never goes down); last_backup is kept.
-- ARGV: 1 backup id ('' = whichever backup the mark names; else only that one)
-- Returns {the id of the backup whose mark it cleared ('' when there was none), the lease's remaining ms when it
-- was cleared (0 or less: it was stale; '' when the mark had no lease)}; error NOSTRUCT when the structure is not
-- in the CF, NOBACKUP when ARGV[1] names another backup than the mark (nothing changed).
if not redis.call('HGET', META, 'state') then
  return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)')
end
local m = redis.call('HMGET', META, 'backup', 'backup_until')
if not m[1] then return {'', ''} end
if ARGV[1] ~= '' and ARGV[1] ~= m[1] then
  return redis.error_reply('NOBACKUP backup ' .. ARGV[1] .. ' is not the one running (' .. m[1] .. ')')
end
redis.call('HDEL', META, 'backup', 'backup_until')
if not m[2] then return {m[1], ''} end
return {m[1], string.format('%d', tonumber(m[2]) - cf_time_ms())}
