-- backup_end: clear the running-backup mark (only the backup that set it may clear it).
-- ARGV: 1 backup id, 2 caller lrsn, 3 outcome ('ok' | 'failed')
-- Returns the end lrsn.
local running = redis.call('HGET', META, 'backup')
if running ~= ARGV[1] then
  return redis.error_reply('NOBACKUP backup ' .. ARGV[1] .. ' is not the one running (' .. tostring(running) .. ')')
end
redis.call('HDEL', META, 'backup')
if ARGV[3] == 'ok' then redis.call('HSET', META, 'last_backup', ARGV[1]) end
return tick(ARGV[2])
