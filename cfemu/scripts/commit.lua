-- commit: apply a UOW's commit to the entries it still holds on this structure.
-- Uncommitted puts become available (in put order); uncommitted gets are deleted.
-- In bounded steps (the prelude's "Outcomes in bounded steps"): a call handles at most ARGV[10] units of work and
-- answers more = 1 until the commit is done; the caller calls again (Structure.commit does). A UOW holding more
-- entries than that is marked committing by the first call, and from then on the commit is decided here: every
-- later commit or backout call for the UOW, from any member, fenced or not, finishes it (the structure must be
-- ACTIVE; the record's LRSN, when one is given, is checked against the floor at every step, so a relog pass that
-- raised the floor meanwhile makes the caller log the decision again, as for a first call).
-- Idempotent: a UOW that holds nothing (already applied) is a no-op. So is a UOW whose work here a purge discarded
-- (tombstone 'P'): a purge discards messages, not outcomes, and the commit goes on on the UOW's other structures.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen, 6 commit lrsn (>0: the forced COMMIT record, log-first;
--       0: a UOW with no persistent work, nothing was logged), 7 record outcome (1: peer recovery or restore decided
--       this outcome for another member's UOW; keep a 'C' tombstone so that the owner learns it when it retries),
--       8 counts-at lrsn (0: ARGV[6]): the LRSN at which the commit counts (sqm.core.records.counts_at: a re-log, or a
--       peer's RECOVERY record, counts at the first record of the decision). The floor is checked against ARGV[6],
--       the record's own LRSN (the one a restore reads it at); the puts are stamped with this one (o1 and l), the
--       LRSN restore places the commit at (docs/log-format.md, "When an outcome counts"); a commit begun in steps
--       keeps the one of its first call,
--       9 later step (1: this caller's previous call of this commit answered more = 1; if the UOW is no longer
--       marked, its commit was finished by another caller, or the rest of it purged or lost with the CF: done),
--       10 step: the most units of work this call does (cfemu.limits.CF_STEP; 0: no bound)
-- A UOW that a restore carried into this generation (its record is here, but the caller started it in an older
-- generation) also leaves a 'C' tombstone: a retry from its owner (after a restart, or for another structure)
-- could not otherwise tell "applied here" from "lost with the CF". A retry from an older generation keeps the
-- tombstone it learns from, so every later retry learns it too.
-- A disconnected persistent store (pstore.lua) does not refuse a commit: a member refuses its own UOW's commit
-- before it forces the COMMIT record (standing.lua's 'D', sqm.core.manager.QueueManager._refuse_if_disconnected). Once
-- the COMMIT is logged the commit is decided and completes on every structure of the UOW: refusing it here would
-- back out on this structure a UOW that another structure had committed.
-- Returns {cf clock, entries made available, entries deleted, more (1: call again)}.
local uow = ARGV[4]
local lrsn = tonumber(ARGV[6])
local at = tonumber(ARGV[8] or '0')
local budget = budget_of(ARGV[10])
local err
local rec = uow_record(uow)
if rec and rec.s then  -- an outcome begun in steps: finish it, whoever calls
  err = check_state() if err then return err end
  if rec.s == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' is being backed out') end
  if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
  local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
  local r = outcome_step(uow, rec, budget, true, ARGV[7] == '1')
  return {cf, r[1], r[2], r[3]}
end
if ARGV[9] == '1' then  -- the commit this caller began is finished here
  err = check_state() if err then return err end
  if tomb(uow) == 'C' and not carried_over(ARGV[5]) then tomb_del(uow) end
  return {tick(ARGV[3]), 0, 0, 0}
end
err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local t = tomb(uow)
if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
if t == 'C' then
  if not carried_over(ARGV[5]) then tomb_del(uow) end
  return {tick(ARGV[3]), 0, 0, 0}
end
if t == 'P' then return {tick(ARGV[3]), 0, 0, 0} end  -- a purge discarded its work here: the outcome stands
if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
err = uow_standing(uow, ARGV[5]) if err then return err end
local carried = carried_over(ARGV[5]) and uow_raw(uow) ~= false
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
if lrsn == 0 then lrsn = cf end
if at == 0 then at = lrsn end
local r = outcome_begin(uow, 'C', at, carried, budget, true, ARGV[7] == '1')
return {cf, r[1], r[2], r[3]}
