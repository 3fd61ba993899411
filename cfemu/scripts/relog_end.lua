-- relog_end: mark the entries a relog pass copied, after their RELOG records are on disk, and (at the pass's
-- completion) age the CPL and release the lock. Marking only after the force keeps a crash harmless: rl never
-- points at a copy that is not on disk. rl only grows (a stale pass's mark never hides a newer copy).
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 relog LRSN R, 5 new CPL (JSON, '' = mark only),
--       6.. entry ids copied at R
-- Returns {cf clock, entries marked}. The CPL is stored and the lock released only when the caller holds it.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local cf = tick(ARGV[3])
local r = tonumber(ARGV[4])
local marked = 0
for i = 6, #ARGV do
  local d = load(ARGV[i])
  if d and (d.rl or 0) < r then
    d.rl = r
    store(d)
    marked = marked + 1
  end
end
if ARGV[5] ~= '' and redis.call('HGET', META, 'relog_owner') == ARGV[1] then
  redis.call('HSET', META, 'relog_cpl', ARGV[5])
  redis.call('HDEL', META, 'relog_owner', 'relog_until')
end
return {cf, marked}
