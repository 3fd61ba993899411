-- peek_scan: read, a batch at a time, the entries of a queue that match a message id or a correlation id, committed
-- (CP) or held by an uncommitted get (UG), without taking them and in no particular order: a sweep over every UOW in
-- one status (sqm.conversations.uowsweeper) costs the CF a bounded batch per call, however many there are (peek sorts them all
-- before its limit, which blocks the CF longer the more statuses are kept: BENCHMARKS.md, "uow"). A full pass is a
-- run of calls from cursor '0' until the returned cursor is '0' again (Redis SSCAN: an entry there for the whole
-- pass is returned at least once; one that comes or goes meanwhile may or may not be).
-- Read only; idempotent.
-- ARGV: 1 queue, 2 match ('m' message id | 'c' correlation id), 3 value (hex), 4 cursor ('0' to start), 5 count hint,
--       6 'H' for the descriptors alone (each data an empty string: a caller that chooses its entries first, then
--       reads the data of those it chose, entry_data.lua, so that a batch's reply does not carry every match's data)
-- Returns {next cursor ('0': the pass is over), descriptor, data, descriptor, data, ...}.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, match, value, cursor, count = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local heads = ARGV[6] == 'H'
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if match ~= 'm' and match ~= 'c' then return redis.error_reply('BADARG match must be m or c') end
if not count or count < 1 or count > 10000 then return redis.error_reply('BADARG count must be 1-10000') end
local scan = redis.call('SSCAN', ixkey(queue, match, value), cursor, 'COUNT', count)
local out = {scan[1]}
for _, id in ipairs(scan[2]) do
  local d = load(id)
  if d and (d.st == 'CP' or d.st == 'UG') then
    out[#out + 1] = cmsgpack.pack(d)
    out[#out + 1] = heads and '' or redis.call('HGET', DATA, id)
  end
end
return out
