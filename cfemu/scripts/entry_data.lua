-- entry_data: the descriptor and data of several entries of a queue, by entry id, each only while it is available
-- (committed: CP): the second step of a lookup that chose its entries from their descriptors alone (peek_scan.lua's
-- heads), so that the CF carries the data of the entries wanted and no others. The caller bounds a call's bytes by
-- the lengths the descriptors said.
-- Read only; idempotent.
-- ARGV: 1 queue, 2.. entry ids, 1-1000 of them
-- Returns {descriptor, data, descriptor, data, ...}: one pair per id, in ARGV's order; two empty strings for an id
-- that is not an available entry of the queue (taken, gone, held by a get, another queue's).
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue = ARGV[1]
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if #ARGV < 2 or #ARGV > 1001 then return redis.error_reply('BADARG give 1-1000 entry ids') end
local out = {}
for i = 2, #ARGV do
  local d = load(ARGV[i])
  push_pair(out, d and d.q == queue and d.st == 'CP' and d or nil)
end
return out
