-- backup_renew: move the running backup's lease on to now + lease (in the CF's time). A backup renews it while it
-- works; a mark that is no longer its own (cancelled: backup_cancel.lua; or replaced by a later backup after its
-- lease ended) or whose lease has ended is refused, and the backup must fail: while its lease had ended, every
-- script treated the structure as having no backup running (backup_mark in the prelude). Not idempotent by
-- design: each call moves the expiry, as admin_heartbeat.lua does for a member's lease.
-- ARGV: 1 backup id, 2 lease (ms)
-- Returns the lease (ms); error NOBACKUP when the mark is not this backup's or its lease has ended, BADARG for a
-- lease that is not a positive number of ms.
local lease = tonumber(ARGV[2])
if not lease or lease < 1 then return redis.error_reply('BADARG lease must be a positive number of ms') end
local m = redis.call('HMGET', META, 'backup', 'backup_until')
if m[1] ~= ARGV[1] then
  return redis.error_reply('NOBACKUP backup ' .. ARGV[1] .. ' is not the one running (' .. tostring(m[1])
    .. '): it was cancelled, or a later backup took its place')
end
local now = cf_time_ms()
if m[2] and tonumber(m[2]) <= now then
  return redis.error_reply(string.format('NOBACKUP backup %s: its lease ended %.1f s ago', ARGV[1],
    (now - tonumber(m[2])) / 1000))
end
redis.call('HSET', META, 'backup_until', string.format('%d', now + lease))
return lease
