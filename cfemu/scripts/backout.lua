-- backout: undo a UOW on this structure. Uncommitted puts are deleted; uncommitted gets return to their place in
-- get order in their priority list with the backout count raised.
-- While a backup of the structure runs, a persistent get may only be backed out by a BACKOUT record that carries
-- the message data (the patent's exception): with has_data = 0 the script refuses with BACKUPACTIVE and the
-- queue manager logs a new record with the data (uow_entries.lua) and retries.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 uow gen, 6 backout lrsn (>0: the forced BACKOUT record;
--       0: nothing was logged), 7 has_data (1 when the record carries the data of the persistent gets),
--       8 record outcome (1: peer recovery or restore decided it; keep a 'B' tombstone for the owner),
--       9 counts-at lrsn (0: ARGV[6]): as in commit.lua, the LRSN the backed-out gets are stamped with
-- A UOW that a restore carried into this generation leaves a 'B' tombstone, as in commit.lua.
-- Returns {cf clock, puts deleted, gets made available again}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local uow = ARGV[4]
local lrsn = tonumber(ARGV[6])
local at = tonumber(ARGV[9] or '0')
local t = redis.call('HGET', TOMB, uow)
if t == 'B' then
  if not carried_over(ARGV[5]) then redis.call('HDEL', TOMB, uow) end
  return {tick(ARGV[3]), 0, 0}
end
if t == 'P' then return {tick(ARGV[3]), 0, 0} end  -- a purge discarded its work here: nothing to undo
if t == 'C' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was committed by recovery') end
if lrsn > 0 then err = floor_check(lrsn) if err then return err end end

local puts, gets = held_entries(uow)
if ARGV[7] ~= '1' and backup_mark() then
  for _, d in ipairs(gets) do
    if d.per == 1 then return redis.error_reply('BACKUPACTIVE a backup is running; log the data of the gets') end
  end
end
local carried = carried_over(ARGV[5]) and redis.call('HEXISTS', UOWS, uow) == 1
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
if lrsn == 0 then lrsn = cf end
if at == 0 then at = lrsn end
for _, d in ipairs(puts) do
  redis.call('LREM', qkey(d.q, 'up'), 1, d.id)
  delete_entry(d)
end
-- A backed-out get returns to its place in get order (its o1 and o2 are unchanged).
for _, d in ipairs(gets) do
  redis.call('LREM', qkey(d.q, 'ug'), 1, d.id)
  d.bc = (d.bc or 0) + 1
  d.l = at
  make_available(d)
  store(d)
end
redis.call('DEL', uowkey(uow))
redis.call('HDEL', UOWS, uow)
if ARGV[8] == '1' or carried then redis.call('HSET', TOMB, uow, 'B') end
return {cf, #puts, #gets}
