-- get: take the next available message of a queue under a UOW (it becomes an uncommitted get).
-- Highest priority first, FIFO within a priority; or the best match by message id / correlation id.
-- Expired messages met on the way are moved to the expired list and never returned.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen (0 = first touch), 6 queue,
--       7 match ('' | 'm' message id | 'c' correlation id), 8 match value (hex), 9 now (ms)
-- Returns {cf clock, gen, descriptor (msgpack), data} or {cf clock, gen} when no message is available.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local queue, uow, match, value = ARGV[6], ARGV[4], ARGV[7], ARGV[8]
local now = tonumber(ARGV[9])
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
err = uow_standing(uow, ARGV[5]) if err then return err end

local function expire(d)
  d.st = 'EX'
  store(d)
  redis.call('RPUSH', qkey(queue, 'ex'), d.id)
end
local function live(d) return not (d.exp and d.exp > 0 and d.exp <= now) end

local found
if match == '' then
  for p = 9, 0, -1 do
    local k = qkey(queue, 'cp:' .. p)
    while true do
      local id = redis.call('LPOP', k)
      if not id then break end
      local d = load(id)
      if d then
        if live(d) then found = d break end
        expire(d)
      end
    end
    if found then break end
  end
else
  local best
  for _, id in ipairs(redis.call('SMEMBERS', ixkey(queue, match, value))) do
    local d = load(id)
    if d and d.st == 'CP' then
      if not live(d) then
        redis.call('LREM', qkey(queue, 'cp:' .. d.p), 1, id)
        expire(d)
      elseif not best or d.p > best.p or (d.p == best.p and (d.o1 < best.o1 or (d.o1 == best.o1 and d.o2 < best.o2))) then
        best = d
      end
    end
  end
  if best then
    redis.call('LREM', qkey(queue, 'cp:' .. best.p), 1, best.id)
    found = best
  end
end

local cf = tick(ARGV[3])
if not found then return {cf, cur_gen()} end
err = join_uow(uow, ARGV[1], cf) if err then return err end
found.st = 'UG'; found.u = uow; found.l = cf
store(found)
redis.call('RPUSH', qkey(queue, 'ug'), found.id)
redis.call('SADD', uowkey(uow), found.id)
return {cf, cur_gen(), cmsgpack.pack(found), redis.call('HGET', DATA, found.id)}
