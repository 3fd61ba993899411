-- relog_scan: one batch of a relog pass: the persistent, unexpired entries whose newest logged copy is old.
-- An entry's newest copy is at max(o2, rl): o2 its put's LRSN (its PUT record's), rl its last RELOG record's
-- (relog_end sets it). Entries in every state qualify (a held entry is copied as held, with its UOW). Each batch
-- is atomic; HSCAN may return an entry twice across batches (a second copy is harmless) and returns every entry
-- present for the whole scan; entries put meanwhile have o2 above any threshold a pass uses.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 threshold T (copies at or below it qualify; -1: every entry),
--       5 HSCAN cursor ('0' to start), 6 batch size
-- Returns {cf clock, next cursor ('0' at the end), scanned, descriptor, data, descriptor, data, ...}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local cf = tick(ARGV[3])
local t = tonumber(ARGV[4])
local r = redis.call('HSCAN', ENT, ARGV[5], 'COUNT', tonumber(ARGV[6]))
local out = {cf, r[1], 0}
local items = r[2]
for i = 1, #items, 2 do
  out[3] = out[3] + 1
  local d = cmsgpack.unpack(items[i + 1])
  local pos = d.o2 or 0
  if (d.rl or 0) > pos then pos = d.rl end
  if d.per ~= 0 and d.st ~= 'EX' and (t < 0 or pos <= t) then
    out[#out + 1] = items[i + 1]
    out[#out + 1] = redis.call('HGET', DATA, items[i]) or ''
  end
end
return out
