-- put: add one message to a queue, as an uncommitted put of a UOW, or (a non-persistent message outside
-- syncpoint, never logged) as a committed put. Persistent puts outside syncpoint are UOWs of their own.
-- Refused (before anything changes, docs/pstore.md): a persistent put while the persistent store is disconnected
-- (PSTORE); any put while the structure takes no new units of work (NONEW), but the replacement of an entry the same
-- UOW takes (a put whose message id is that of an uncommitted get of the UOW on the queue: a status change of a UOW
-- or a subscription's new position, consuming work that adds nothing, and exempt from the capacity check too). A
-- replacement is bounded, as any application may put with a message id (the service's put): one per entry the UOW
-- takes (a UOW's puts with that message id on the queue are fewer than its gets of it), and no longer than the
-- longest of those entries plus REPLACEMENT_SLACK bytes (a status may grow by a user status, a position by a few
-- digits); any other put is checked as a new one. A put refused for capacity (FULL) puts the structure in the "no
-- new units of work" state (nonew = FULL) when the structure, without that put, is above its low-water mark; that
-- state ends at or below the mark (the prelude's account() where entries leave, and here).
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow ('' = outside syncpoint), 5 uow gen (0 = first touch),
--       6 entry id, 7 queue, 8 descriptor (msgpack map: p, per, mid, cid, exp, pt, bc, pr, len), 9 data
-- Returns {cf clock, gen, created (1, or 0 when the id already exists: puts are idempotent by id)}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local queue, id, uow = ARGV[7], ARGV[6], ARGV[4]
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if uow ~= '' then
  err = uow_standing(uow, ARGV[5]) if err then return err end
  err = uow_owner_check(uow, ARGV[1]) if err then return err end  -- before anything changes
end
if redis.call('HEXISTS', ENT, id) == 1 then return {tick(ARGV[3]), cur_gen(), 0} end
local data = ARGV[9]
local d = cmsgpack.unpack(ARGV[8])
if d.per == 1 and disconnected() then return pstore_refusal('a persistent message cannot be put') end

-- A replacement: the UOW holds an uncommitted get of an entry with this message id on this queue that it has not
-- replaced yet, and this put is not much longer than it (the head comment).
local REPLACEMENT_SLACK = 256
local function replacement()
  if uow == '' or not d.mid or d.mid == '' then return false end
  local taken, replaced, longest = 0, 0, 0
  for _, other in ipairs(redis.call('SMEMBERS', ixkey(queue, 'm', d.mid))) do
    local o = load(other)
    if o and o.u == uow then
      if o.st == 'UG' then
        taken = taken + 1
        if (o.len or 0) > longest then longest = o.len or 0 end
      elseif o.st == 'UP' then
        replaced = replaced + 1
      end
    end
  end
  return replaced < taken and #data <= longest + REPLACEMENT_SLACK
end
err = admit(#data, replacement) if err then return err end

d.id = id; d.q = queue; d.len = #data
local cf = tick(ARGV[3])
if uow ~= '' then
  err = join_uow(uow, ARGV[1], cf) if err then return err end
  d.st = 'UP'; d.u = uow; d.l = cf; d.o1 = 0; d.o2 = cf
  redis.call('SADD', uowkey(uow), id)
  redis.call('RPUSH', qkey(queue, 'up'), id)
else
  d.l = cf; d.o1 = cf; d.o2 = cf
  make_available(d)
end
add_entry(d, data)
return {cf, cur_gen(), 1}
