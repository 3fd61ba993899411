-- admin_forget: after peer recovery, take a member off the list of live members, unless it joined again since it
-- was fenced (its epoch is no longer the one the recoverer gave it): a member that restarted while a peer was
-- recovering its previous incarnation is listed, and so recovered in its turn if it fails later.
-- Idempotent.
-- KEYS: 1 the members hash ({ADMIN}:members), 2 the epochs hash ({ADMIN}:epochs)
-- ARGV: 1 member, 2 the epoch its fencing gave it
-- Returns 1 forgotten (or not listed), 0 left listed (it joined again).
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur and cur ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
