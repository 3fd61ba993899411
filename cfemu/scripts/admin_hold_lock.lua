-- admin_hold_lock: renew or release a lock in the admin structure, only for the holder that took it (SET NX PX):
-- a holder whose lock lapsed and was taken by another can neither extend nor delete the other's.
-- Idempotent: renewing moves the expiry to now + ttl again; releasing a lock already gone returns 0.
-- KEYS: 1 the lock ({ADMIN}:recauto:<structure>)
-- ARGV: 1 holder (the value it was taken with), 2 ttl (ms): > 0 renew, 0 release
-- Returns 1 renewed or released, 0 not held by this holder (lapsed, or another's).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
