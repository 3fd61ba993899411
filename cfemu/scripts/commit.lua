-- commit: apply a UOW's commit to the entries it still holds on this structure.
-- Uncommitted puts become available (in put order); uncommitted gets are deleted.
-- Idempotent: a UOW that holds nothing (already applied) is a no-op. So is a UOW whose work here a purge discarded
-- (tombstone 'P'): a purge discards messages, not outcomes, and the commit goes on on the UOW's other structures.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen, 6 commit lrsn (>0: the forced COMMIT record, log-first;
--       0: a UOW with no persistent work, nothing was logged), 7 record outcome (1: peer recovery or restore decided
--       this outcome for another member's UOW; keep a 'C' tombstone so that the owner learns it when it retries),
--       8 counts-at lrsn (0: ARGV[6]): the LRSN at which the commit counts (sqm.records.counts_at: a re-log, or a
--       peer's RECOVERY record, counts at the first record of the decision). The floor is checked against ARGV[6],
--       the record's own LRSN (the one a restore reads it at); the puts are stamped with this one (o1 and l), the
--       LRSN restore places the commit at (docs/log-format.md, "When an outcome counts").
-- A UOW that a restore carried into this generation (its record is here, but the caller started it in an older
-- generation) also leaves a 'C' tombstone: a retry from its owner (after a restart, or for another structure)
-- could not otherwise tell "applied here" from "lost with the CF". A retry from an older generation keeps the
-- tombstone it learns from, so every later retry learns it too.
-- A disconnected persistent store (pstore.lua) does not refuse a commit: a member refuses its own UOW's commit
-- before it forces the COMMIT record (standing.lua's 'D', sqm.manager.QueueManager._refuse_if_disconnected). Once
-- the COMMIT is logged the commit is decided and completes on every structure of the UOW: refusing it here would
-- back out on this structure a UOW that another structure had committed (a message moved between two structures
-- would be lost, the log holding COMMIT then BACKOUT).
-- Returns {cf clock, entries made available, entries deleted}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local uow = ARGV[4]
local lrsn = tonumber(ARGV[6])
local at = tonumber(ARGV[8] or '0')
local t = redis.call('HGET', TOMB, uow)
if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
if t == 'C' then
  if not carried_over(ARGV[5]) then redis.call('HDEL', TOMB, uow) end
  return {tick(ARGV[3]), 0, 0}
end
if t == 'P' then return {tick(ARGV[3]), 0, 0} end  -- a purge discarded its work here: the outcome stands
if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
err = uow_standing(uow, ARGV[5]) if err then return err end
local carried = carried_over(ARGV[5]) and redis.call('HEXISTS', UOWS, uow) == 1
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
if lrsn == 0 then lrsn = cf end
if at == 0 then at = lrsn end

local puts, gets = held_entries(uow)
table.sort(puts, function(a, b) return a.o2 < b.o2 end)
for _, d in ipairs(puts) do
  redis.call('LREM', qkey(d.q, 'up'), 1, d.id)
  d.l = at; d.o1 = at
  make_available(d)
  store(d)
end
for _, d in ipairs(gets) do
  redis.call('LREM', qkey(d.q, 'ug'), 1, d.id)
  delete_entry(d)
end
redis.call('DEL', uowkey(uow))
redis.call('HDEL', UOWS, uow)
if ARGV[7] == '1' or carried then redis.call('HSET', TOMB, uow, 'C') end
return {cf, #puts, #gets}
