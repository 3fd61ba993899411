-- admin_fence: give a lapsed member a new epoch, so that every CF call it makes with its old one is refused
-- (FENCED). The check of the lease and the bump are one step: a member that restarted since a peer saw it lapsed
-- holds a lease again and is left alone.
-- Only a lease the member's own join or heartbeat wrote (a string with a time to live) counts as one. Any other
-- value at the lease key (another type, or no time to live: written by hand or by a holder of a CF password) is
-- no lease and no proof of a lapse either: it is replaced by a lease of ARGV 3 ms and the member is left alone.
-- A live member's next heartbeat renews it; a dead member's lapses, and the next call fences it.
-- A member no longer listed left the group cleanly (its leave takes the lease and the listing away in one step)
-- or was recovered already: a peer that listed it a moment before its leave has nothing to recover or fence.
-- The new epoch is above the old one and at least now (ms), so epochs keep growing across the loss of the CF.
-- KEYS: 1 the member's lease ({ADMIN}:lease:<member>), 2 the epochs hash ({ADMIN}:epochs), 3 the members hash
-- ({ADMIN}:members)
-- ARGV: 1 member, 2 now (ms), 3 the lease a malformed lease key is repaired to (ms)
-- Returns the new epoch, 0 when the member holds a lease (it is alive: not to be fenced; nothing changed), -1
-- when the lease key held something else (repaired; not fenced), or -2 when the member is not listed (it left:
-- nothing changed).
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' then
  if kind == 'string' and redis.call('PTTL', KEYS[1]) > 0 then return 0 end
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[1], 'repaired', 'PX', ARGV[3])
  return -1
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then return -2 end
local epoch = math.max(tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0') + 1, tonumber(ARGV[2]))
redis.call('HSET', KEYS[2], ARGV[1], epoch)
return epoch
