-- get: take the next available message of a queue under a UOW (it becomes an uncommitted get).
-- Highest priority first, FIFO within a priority; or the best match by message id / correlation id.
-- Expired messages met on the way are moved to the expired list and never returned.
-- Refusals change nothing but that expiry (Redis does not roll a script back, so every check comes before the
-- message is touched): BADUOW when another member's UOW has that id; TOOLONG when the message it would take is
-- longer than the caller can carry (ARGV[10]): the message stays where it was, its backout count unchanged, no
-- UOW joined, nothing for the caller to log (MQ's MQRC_TRUNCATED_MSG_FAILED for a buffer that is too small).
-- PSTORE: the message it would take is persistent and the persistent store is disconnected (docs/pstore.md): it
-- stays where it was, as for TOOLONG.
-- A call does at most ARGV[11] units of work on the expired messages at the head of the lists (the prelude's
-- "Outcomes in bounded steps": one unit an expired message moved): when that budget runs out before it finds a live
-- message, it answers 'call again' having taken nothing and changed nothing but that expiry (no UOW joined, the
-- clock not moved), and the next call goes on from the head the expiry left (Structure.get calls again).
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen (0 = first touch), 6 queue,
--       7 match ('' | 'm' message id | 'c' correlation id), 8 match value (hex), 9 now (ms),
--       10 the longest message the caller can take, data plus descriptor as stored (bytes; 0 or absent = any),
--       11 step (the most expired messages to move; 0 or absent: no bound)
-- Returns {cf clock, gen, descriptor (msgpack), data}; {cf clock, gen} when no message is available; or
-- {cf clock, gen, 1} (call again) when the step ran out among expired messages before a live one.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local queue, uow, match, value = ARGV[6], ARGV[4], ARGV[7], ARGV[8]
local now = tonumber(ARGV[9])
local max_length = tonumber(ARGV[10] or '0') or 0
local budget = budget_of(ARGV[11])
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
err = uow_standing(uow, ARGV[5]) if err then return err end
err = uow_owner_check(uow, ARGV[1]) if err then return err end

local function expire(d)
  d.st = 'EX'
  store(d)
  redis.call('RPUSH', qkey(queue, 'ex'), d.id)
end
local function live(d) return not (d.exp and d.exp > 0 and d.exp <= now) end

-- The highest priority at or below `top` whose list holds an entry (Redis deletes an empty list), and its list; nil
-- when there is none. EXISTS counts the lists that exist among those it is given: one over all of them, one over
-- all but the lowest (priority 0, the usual one), then a binary search over the rest.
local function highest(top)
  local ks = {}
  for p = top, 0, -1 do ks[#ks + 1] = qkey(queue, 'cp:' .. p) end
  if redis.call('EXISTS', unpack(ks)) == 0 then return nil end
  local lo, hi = 1, #ks
  if hi > 1 then
    if redis.call('EXISTS', unpack(ks, 1, hi - 1)) == 0 then lo = hi else hi = hi - 1 end
  end
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if redis.call('EXISTS', unpack(ks, lo, mid)) > 0 then hi = mid else lo = mid + 1 end
  end
  return top - lo + 1, ks[lo]
end

-- Find the message without taking it: the head of the highest non-empty priority list, or the best match.
-- The match's index holds only the messages with that id: its walk is bounded by them, not by the queue.
local found, head_of
local used, again = 0, false  -- expired messages moved from the heads; the step ran out before a live one
if match == '' then
  local top = 9
  while not found and not again and top >= 0 do
    local p, k = highest(top)
    if not p then break end
    while true do
      local id = redis.call('LINDEX', k, 0)
      if not id then break end
      local d = load(id)
      if d and live(d) then found, head_of = d, k break end
      if used >= budget then again = true break end
      used = used + 1
      redis.call('LPOP', k)
      if d then expire(d) end
    end
    top = p - 1
  end
else
  for _, id in ipairs(redis.call('SMEMBERS', ixkey(queue, match, value))) do
    local d = load(id)
    if d and d.st == 'CP' then
      if not live(d) then
        redis.call('LREM', qkey(queue, 'cp:' .. d.p), 1, id)
        expire(d)
      elseif not found or d.p > found.p or (d.p == found.p and before(d, found)) then
        found = d
      end
    end
  end
end

if again then return {tonumber(meta('clock') or '0'), cur_gen(), 1} end
if found and found.per == 1 and disconnected() then
  return pstore_refusal('message ' .. found.id .. ' on ' .. queue .. ' is persistent and cannot be taken')
end
if found and max_length > 0 then
  local length = carried_length(found.id)
  if length > max_length then return too_long_reply(found.id, length, max_length) end
end

local cf = tick(ARGV[3])
if not found then return {cf, cur_gen()} end
join_uow(uow, ARGV[1], cf)  -- cannot refuse: the owner was checked above
if head_of then
  redis.call('LPOP', head_of)  -- found is that list's head
else
  redis.call('LREM', qkey(queue, 'cp:' .. found.p), 1, found.id)
end
found.st = 'UG'; found.u = uow; found.l = cf
local desc = store(found)
redis.call('RPUSH', qkey(queue, 'ug'), found.id)
redis.call('SADD', uowkey(uow), found.id)
return {cf, cur_gen(), desc, redis.call('HGET', DATA, found.id)}
