-- admin_raise_fence: carry a member's epoch into one structure's fence. A fence only moves up, so a late write
-- of an older epoch cannot unfence a newer incarnation of the member.
-- Idempotent: raising to the epoch already there (or below it) changes nothing.
-- KEYS: 1 the structure's fence hash ({S}:fence)
-- ARGV: 1 member, 2 epoch
-- Returns 1.
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
