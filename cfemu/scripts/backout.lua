-- backout: undo a UOW on this structure. Uncommitted puts are deleted; uncommitted gets return to their place in
-- get order in their priority list with the backout count raised.
-- In bounded steps, as commit.lua: a call does at most ARGV[11] units of work and answers more = 1 until the backout
-- is done. A UOW holding more entries than that is marked backing out by the first call; from then on every later
-- backout call for the UOW, from any member, finishes it, and a commit is refused (BACKEDOUT: puts deleted cannot be
-- made available). A backout of a UOW marked committing finishes its commit instead (puts made available cannot
-- be taken back: a UOW whose commit has begun is committed) and answers no puts deleted, no gets returned.
-- While a backup of the structure runs, a persistent get may only be backed out by a BACKOUT record that carries
-- the message data (the patent's exception): with has_data = 0 the script refuses with BACKUPACTIVE (at any step,
-- before it changes anything in that call) and the queue manager logs a new record with the data (uow_entries.lua)
-- and retries.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen, 6 backout lrsn (>0: the forced BACKOUT record;
--       0: nothing was logged), 7 has_data (1 when the record carries the data of the persistent gets),
--       8 record outcome (1: peer recovery or restore decided it; keep a 'B' tombstone for the owner),
--       9 counts-at lrsn (0: ARGV[6]): as in commit.lua, the LRSN the backed-out gets are stamped with,
--       10 later step (1: this caller's previous call answered more = 1), 11 step (the most units of work this
--       call does; 0: no bound): both as in commit.lua
-- A UOW that a restore carried into this generation leaves a 'B' tombstone, as in commit.lua.
-- Returns {cf clock, puts deleted, gets made available again, more (1: call again)}.
local uow = ARGV[4]
local lrsn = tonumber(ARGV[6])
local at = tonumber(ARGV[9] or '0')
local budget = budget_of(ARGV[11])
local has_data = ARGV[7] == '1'
local err
local rec = uow_record(uow)
if rec and rec.s then  -- an outcome begun in steps: finish it, whoever calls
  err = check_state() if err then return err end
  local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
  if rec.s == 'C' then
    local r = outcome_step(uow, rec, budget, true, ARGV[8] == '1')
    return {cf, 0, 0, r[3]}
  end
  if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
  local r = outcome_step(uow, rec, budget, has_data, ARGV[8] == '1')
  if not r then return redis.error_reply('BACKUPACTIVE a backup is running; log the data of the gets') end
  return {cf, r[1], r[2], r[3]}
end
if ARGV[10] == '1' then  -- the backout this caller began is finished here
  err = check_state() if err then return err end
  if tomb(uow) == 'B' and not carried_over(ARGV[5]) then tomb_del(uow) end
  return {tick(ARGV[3]), 0, 0, 0}
end
err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local t = tomb(uow)
if t == 'B' then
  if not carried_over(ARGV[5]) then tomb_del(uow) end
  return {tick(ARGV[3]), 0, 0, 0}
end
if t == 'P' then return {tick(ARGV[3]), 0, 0, 0} end  -- a purge discarded its work here: nothing to undo
if t == 'C' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was committed by recovery') end
if t == 'A' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was put and committed') end
if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
if not has_data and backup_mark() and redis.call('SCARD', uowkey(uow)) <= budget then
  local _, gets = held_entries(uow)
  for _, d in ipairs(gets) do
    if d.per == 1 then return redis.error_reply('BACKUPACTIVE a backup is running; log the data of the gets') end
  end
end
local carried = carried_over(ARGV[5]) and uow_raw(uow) ~= false
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
if lrsn == 0 then lrsn = cf end
if at == 0 then at = lrsn end
local r = outcome_begin(uow, 'B', at, carried, budget, has_data, ARGV[8] == '1')
if not r then return redis.error_reply('BACKUPACTIVE a backup is running; log the data of the gets') end
return {cf, r[1], r[2], r[3]}
