-- peek: read the entries of a queue that match a message id or a correlation id, without taking them: committed
-- ones (CP), and ones an uncommitted get holds (UG) as the CF holds them (their last committed content: a get takes a
-- message, it does not change it). A unit of work's status lookup (sqm.conversations.conversation) must see a status that a
-- transition holds for a moment, where browse sees only what is available.
-- Read only; idempotent.
-- ARGV: 1 queue, 2 match ('m' message id | 'c' correlation id), 3 value (hex), 4 max count
-- Returns {descriptor, data, descriptor, data, ...} in get order (priority, then FIFO), at most ARGV[4] pairs.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, match, value, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if match ~= 'm' and match ~= 'c' then return redis.error_reply('BADARG match must be m or c') end
local found = {}
for _, id in ipairs(redis.call('SMEMBERS', ixkey(queue, match, value))) do
  local d = load(id)
  if d and (d.st == 'CP' or d.st == 'UG') then found[#found + 1] = d end
end
table.sort(found, function(a, b) return a.p > b.p or (a.p == b.p and before(a, b)) end)
local out = {}
for i = 1, math.min(#found, limit) do
  out[#out + 1] = cmsgpack.pack(found[i])
  out[#out + 1] = redis.call('HGET', DATA, found[i].id)
end
return out
