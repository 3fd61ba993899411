-- commit: apply a UOW's commit to the entries it still holds on this structure.
-- Uncommitted puts become available (in put order); uncommitted gets are deleted.
-- Idempotent: a UOW that holds nothing (already applied) is a no-op. So is a UOW whose work here a purge discarded
-- (tombstone 'P'): a purge discards messages, not outcomes, and the commit goes on on the UOW's other structures.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen, 6 commit lrsn (>0: the forced COMMIT record, log-first;
--       0: a UOW with no persistent work, nothing was logged), 7 record outcome (1: peer recovery or restore decided
--       this outcome for another member's UOW; keep a 'C' tombstone so that the owner learns it when it retries)
-- Returns {cf clock, entries made available, entries deleted}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local uow = ARGV[4]
local lrsn = tonumber(ARGV[6])
local t = redis.call('HGET', TOMB, uow)
if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
if t == 'C' then redis.call('HDEL', TOMB, uow) return {tick(ARGV[3]), 0, 0} end
if t == 'P' then return {tick(ARGV[3]), 0, 0} end
if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
err = uow_standing(uow, ARGV[5]) if err then return err end
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
if lrsn == 0 then lrsn = cf end

local puts, gets = held_entries(uow)
table.sort(puts, function(a, b) return a.o2 < b.o2 end)
for _, d in ipairs(puts) do
  redis.call('LREM', qkey(d.q, 'up'), 1, d.id)
  d.l = lrsn; d.o1 = lrsn
  make_available(d)
  store(d)
end
for _, d in ipairs(gets) do
  redis.call('LREM', qkey(d.q, 'ug'), 1, d.id)
  delete_entry(d)
end
redis.call('DEL', uowkey(uow))
redis.call('HDEL', UOWS, uow)
if ARGV[7] == '1' then redis.call('HSET', TOMB, uow, 'C') end
return {cf, #puts, #gets}
