-- backup_withdraw: a backup that ended ok here and then could not be kept (its manifest, written after its end
-- because it holds the end's lrsn, could not be written: a full or failing disk) is withdrawn: the header's
-- last_backup, while it still names that backup, names the one before it again (or none). Nothing else changes:
-- its mark was cleared when it ended, and its copies are gone with it.
-- ARGV: 1 the withdrawn backup's id, 2 the last backup before it ('' when there was none)
-- Returns 1 when last_backup named it and was set back; 0 when it names another (a later backup, a restore's
-- point), which is left as it is.
if redis.call('HGET', META, 'last_backup') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('HDEL', META, 'last_backup')
else
  redis.call('HSET', META, 'last_backup', ARGV[2])
end
return 1
