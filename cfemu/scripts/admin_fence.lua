-- admin_fence: give a lapsed member a new epoch, so that every CF call it makes with its old one is refused
-- (FENCED). The check of the lease and the bump are one step: a member that restarted since a peer saw it lapsed
-- holds a lease again and is left alone.
-- The new epoch is above the old one and at least now (ms), so epochs keep growing across the loss of the CF.
-- KEYS: 1 the member's lease ({ADMIN}:lease:<member>), 2 the epochs hash ({ADMIN}:epochs)
-- ARGV: 1 member, 2 now (ms)
-- Returns the new epoch, or 0 when the member holds a lease (it is alive: not to be fenced; nothing changed).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local epoch = math.max(tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') + 1, tonumber(ARGV[2]))
redis.call('HSET', KEYS[2], ARGV[1], epoch)
return epoch
