-- put: add one message to a queue, as an uncommitted put of a UOW, or (a non-persistent message outside
-- syncpoint, never logged) as a committed put. Persistent puts outside syncpoint are UOWs of their own.
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
err = capacity_check(1, #data) if err then return err end

local d = cmsgpack.unpack(ARGV[8])
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
store(d)
redis.call('HSET', DATA, id, data)
if d.exp and d.exp > 0 then redis.call('ZADD', EXPIRY, d.exp, id) end
if d.cid and d.cid ~= '' then redis.call('SADD', ixkey(queue, 'c', d.cid), id) end
if d.mid and d.mid ~= '' then redis.call('SADD', ixkey(queue, 'm', d.mid), id) end
account(1, #data)
return {cf, cur_gen(), 1}
