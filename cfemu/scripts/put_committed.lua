-- put_committed: a persistent put outside syncpoint and its commit as one operation. The caller logged the put and
-- its commit first (a PUT record and a forced COMMIT, its own UOW: log-first, so the message is available the
-- moment this call returns and its records are on disk before): this call makes the message available, in get
-- order at the commit's LRSN (o1) and the put's (o2), as restore's fold places a PUT and its COMMIT.
-- Applied once per UOW, whoever calls: the call leaves tombstone 'A' for its UOW, so that a redo from the log (peer
-- recovery or a restart, which find the COMMIT without its END) cannot bring back a message consumed since; the
-- entry's presence says the same while it is there. The owner names, in ARGV[14], UOWs whose END records are on
-- disk since its last call: no redo can come for them any more, and their tombstones go.
-- Refused before anything changes (the caller then logs a BACKOUT: a COMMIT followed by a BACKOUT is a commit the
-- CF refused): a fenced or unjoined member, a structure that is not ACTIVE, an unknown queue, records below the
-- recovery floor (FLOOR), records naming an older generation of the structure (BACKEDOUT: restored since),
-- and, unless this is a redo (ARGV[13] = 1: the records' outcome is decided and must complete), a disconnected
-- persistent store (PSTORE), no new units of work (NONEW) and capacity (FULL), as put.lua refuses them.
-- ARGV: 1 member, 2 epoch, 3 caller lrsn, 4 uow, 5 gen (the structure generation the records name; never 0),
--       6 entry id, 7 queue, 8 descriptor (msgpack map, as put.lua's), 9 data, 10 put lrsn (the PUT record's),
--       11 commit lrsn (the COMMIT record's), 12 counts-at lrsn (0: ARGV[11]; as commit.lua's ARGV[8]),
--       13 redo (1: peer recovery or a restart redoes it from the log), 14 forget: UOW ids, space-separated
-- Returns {cf clock, gen, applied (1, or 0 when this UOW's put was applied already)}.
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local uow, id, queue = ARGV[4], ARGV[6], ARGV[7]
local put_lrsn, lrsn = tonumber(ARGV[10]), tonumber(ARGV[11])
local at = tonumber(ARGV[12] or '0') or 0
if at == 0 then at = lrsn end
local redo = ARGV[13] == '1'
for u in string.gmatch(ARGV[14] or '', '%S+') do
  if tomb(u) == 'A' then tomb_del(u) end
end
local t = tomb(uow)
if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
if t or redis.call('HEXISTS', ENT, id) == 1 then  -- applied already (or its work here purged)
  return {tick(math.max(tonumber(ARGV[3]), lrsn)), cur_gen(), 0}
end
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if tonumber(ARGV[5]) ~= cur_gen() then
  return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' names generation ' .. ARGV[5] ..
    ' of the structure, which a restore replaced by ' .. cur_gen())
end
err = floor_check(put_lrsn) if err then return err end
local data = ARGV[9]
local d = cmsgpack.unpack(ARGV[8])
if not redo then
  if disconnected() then return pstore_refusal('a persistent message cannot be put') end
  err = admit(#data) if err then return err end
end
d.id = id; d.q = queue; d.len = #data; d.l = at; d.o1 = at; d.o2 = put_lrsn
local cf = tick(math.max(tonumber(ARGV[3]), lrsn))
make_available(d)
add_entry(d, data)
redis.call('HSET', TOMB, uow, 'A')
return {cf, cur_gen(), 1}
