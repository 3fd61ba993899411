-- admin_heartbeat: renew a member's lease, unless its epoch is no longer current (a peer fenced it meanwhile)
-- or the admin structure no longer knows it (the CF was lost).
-- Not idempotent by design: each call moves the lease's expiry to now + ttl.
-- KEYS: 1 the member's lease ({ADMIN}:lease:<member>), 2 the epochs hash ({ADMIN}:epochs)
-- ARGV: 1 member, 2 epoch (the member's own), 3 lease ttl (ms)
-- Returns 1 renewed, 0 fenced (another epoch is current), -1 unknown member (the CF was lost: re-join).
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if not cur then return -1 end
if cur ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
