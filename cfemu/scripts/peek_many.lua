-- peek_many: what peek.lua returns first (the entry a get would meet first) for each of several message ids or
-- correlation ids, in one call: a receive reads the records of every conversation in its window at once
-- (sqm.conversations.bindings), one CF call where one per conversation made a waiting receive's cost grow with the
-- number of conversations it could not take. Committed entries (CP) and ones an uncommitted get holds (UG).
-- Read only; idempotent.
-- ARGV: 1 queue, 2 match ('m' message id | 'c' correlation id), 3.. the values (hex), 1-1000 of them
-- Returns {descriptor, data, descriptor, data, ...}: one pair per value, in ARGV's order; two empty strings for a
-- value no entry carries.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, match = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if match ~= 'm' and match ~= 'c' then return redis.error_reply('BADARG match must be m or c') end
if #ARGV < 3 or #ARGV > 1002 then return redis.error_reply('BADARG give 1-1000 values') end
local out = {}
for i = 3, #ARGV do
  local first = nil
  for _, id in ipairs(redis.call('SMEMBERS', ixkey(queue, match, ARGV[i]))) do
    local d = load(id)
    if d and (d.st == 'CP' or d.st == 'UG') and (first == nil or d.p > first.p or (d.p == first.p and before(d, first))) then
      first = d
    end
  end
  push_pair(out, first)
end
return out
