-- backup_end: clear the running-backup mark (only the backup that set it may clear it).
-- A backup ends 'ok' only while its lease runs: once it has ended, every script treated the structure as having
-- no backup running (backup_mark in the prelude), so the copy may lack what a running backup relies on. It may
-- always end 'failed' while the mark is its own, stale or not. The floor is left as it is (it never goes down).
-- ARGV: 1 backup id, 2 caller lrsn, 3 outcome ('ok' | 'failed')
-- Returns the end lrsn; error NOBACKUP when the mark is not this backup's (cancelled, replaced by a later backup
-- after its lease ended, or lost with the CF), or for 'ok' when its lease has ended. A refusal changes nothing.
local m = redis.call('HMGET', META, 'backup', 'backup_until')
local running = m[1]
if running ~= ARGV[1] then
  return redis.error_reply('NOBACKUP backup ' .. ARGV[1] .. ' is not the one running (' .. tostring(running) .. ')')
end
if ARGV[3] == 'ok' and m[2] then
  local now = cf_time_ms()
  if tonumber(m[2]) <= now then
    return redis.error_reply(string.format('NOBACKUP backup %s: its lease ended %.1f s ago; it cannot end ok',
      ARGV[1], (now - tonumber(m[2])) / 1000))
  end
end
redis.call('HDEL', META, 'backup', 'backup_until')
if ARGV[3] == 'ok' then redis.call('HSET', META, 'last_backup', ARGV[1]) end
return tick(ARGV[2])
