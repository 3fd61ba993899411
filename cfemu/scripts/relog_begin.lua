-- relog_begin: begin a relog pass on the structure (selective relogging, from IBM's recovery-enhancement patent:
-- docs/log-management.md).
-- Takes the structure's relog lock for the caller (refused while another member holds it and its lease runs),
-- ticks the clock to the pass's begin B and raises the recovery floor to B (floor = max(floor, B)): from here on an
-- outcome record below B is refused (FLOOR) and re-logged above it, so every outcome applied after a copy of this
-- pass lies inside any window that holds the copy. Idempotent for the lock holder (a second call only moves B on).
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 now (ms), 5 lock lease (ms)
-- Returns {B, gen, cpl (the stored CPL as JSON {"g": gen, "p": [[b, e], ...]}, or '' when none), first (the lowest
-- first LRSN of the UOWs holding entries, B when none: an in-doubt UOW's PREPARE lies above it), carried (the UOWs
-- holding entries that started in an older generation: carried across a restore)};
-- error RELOGBUSY when another member holds the lock, or while the structure runs from a WARM start.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
if redis.call('HGET', META, 'started') == 'WARM' then
  -- Its persistent content is in its older backups and the logs: a pass over the empty structure would be a newer
  -- restore base than them (restore and log retention would then drop what committed before the loss).
  return redis.error_reply('RELOGBUSY no relog pass while the structure runs from a WARM start (docs/pstore.md)')
end
local owner, untl = unpack(redis.call('HMGET', META, 'relog_owner', 'relog_until'))
local now = tonumber(ARGV[4])
if owner and owner ~= ARGV[1] and tonumber(untl or '0') > now then
  return redis.error_reply('RELOGBUSY relog lock held by ' .. owner)
end
local b = tick(ARGV[3])
local floor = tonumber(redis.call('HGET', META, 'floor') or '0')
if b > floor then redis.call('HSET', META, 'floor', b) end
redis.call('HSET', META, 'relog_owner', ARGV[1], 'relog_until', now + tonumber(ARGV[5]))
local first, carried, gen = b, {}, cur_gen()
local all = redis.call('HGETALL', UOWS)
for i = 1, #all, 2 do
  local u = cmsgpack.unpack(all[i + 1])
  if u.f and u.f < first then first = u.f end
  if u.g and u.g ~= 0 and u.g ~= gen then carried[#carried + 1] = all[i] end
end
return {b, gen, redis.call('HGET', META, 'relog_cpl') or '', first, carried}
