-- _prelude: shared helpers, prepended to every CF script when it is loaded (Redis Lua has no include).
-- Every script gets the same KEYS, all inside one structure's hash tag {S} (one cluster slot):
--   KEYS[1] {S}:meta    hash  state, gen, clock, floor, backup, backup_until, entries, bytes, max_entries,
--                             max_bytes, pstore, nonew
--   KEYS[2] {S}:fence   hash  member -> epoch (fencing of stale queue managers)
--   KEYS[3] {S}:ent     hash  entry id -> msgpack descriptor
--   KEYS[4] {S}:data    hash  entry id -> message data
--   KEYS[5] {S}:uows    hash  uow id -> msgpack {o = owner member, f = first lrsn, g = gen}
--   KEYS[6] {S}:tomb    hash  uow id -> 'C' | 'B' (an outcome decided by peer recovery or restore), or 'P' (the
--                             UOW's work on this structure was discarded by a purge: its outcome is not decided)
--   KEYS[7] {S}:queues  set   queue names defined on the structure
--   KEYS[8] {S}:expiry  zset  entry id scored by expiry time (ms)
-- Per-queue lists are derived from the tag (same slot): {S}:q:<queue>:up|ug|ex|cp:<0-9>,
-- per-UOW sets {S}:uow:<uow>, and correlation/message id indexes {S}:ix:<queue>:c|m:<hex>.
-- Python names the same keys in cfemu/keys.py (keys.SCRIPT_KEYS is this order; tests/cfemu/test_scripts.py checks
-- it); every key, its fields and its writers: docs/cf-layout.md.
local META, FENCE, ENT, DATA, UOWS, TOMB, QUEUES, EXPIRY =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local PREFIX = string.sub(META, 1, #META - 4)

local function qkey(queue, suffix) return PREFIX .. 'q:' .. queue .. ':' .. suffix end
local function uowkey(uow) return PREFIX .. 'uow:' .. uow end
local function ixkey(queue, kind, value) return PREFIX .. 'ix:' .. queue .. ':' .. kind .. ':' .. value end

-- The structure's Lamport clock: cf = max(cf, caller) + 1; the caller adopts the result.
local function tick(caller)
  local cf = tonumber(redis.call('HGET', META, 'clock') or '0')
  local c = tonumber(caller) or 0
  if c > cf then cf = c end
  cf = cf + 1
  redis.call('HSET', META, 'clock', cf)
  return cf
end

-- Refuse work unless the structure is ACTIVE and the caller's epoch is current.
local function check_ready(member, epoch)
  local st = redis.call('HGET', META, 'state')
  if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
  if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
  local cur = redis.call('HGET', FENCE, member)
  if not cur then return redis.error_reply('NOTJOINED member ' .. member .. ' has not joined this structure') end
  if cur ~= epoch then
    return redis.error_reply('FENCED member ' .. member .. ' epoch ' .. epoch .. ' is stale (current ' .. cur .. ')')
  end
  return nil
end

-- Log-first records must not sit below the structure's recovery floor (docs/architecture.md, "Recovery floor").
local function floor_check(lrsn)
  local floor = tonumber(redis.call('HGET', META, 'floor') or '0')
  if lrsn < floor then return redis.error_reply('FLOOR ' .. string.format('%d', floor)) end
  return nil
end

local function capacity_check(entries, bytes)
  local m = redis.call('HMGET', META, 'entries', 'bytes', 'max_entries', 'max_bytes')
  local n, b = tonumber(m[1] or '0'), tonumber(m[2] or '0')
  local maxn, maxb = tonumber(m[3] or '0'), tonumber(m[4] or '0')
  if maxn > 0 and n + entries > maxn then
    return redis.error_reply('FULL structure holds ' .. n .. ' of ' .. maxn .. ' entries')
  end
  if maxb > 0 and b + bytes > maxb then
    return redis.error_reply('FULL structure holds ' .. b .. ' of ' .. maxb .. ' bytes')
  end
  return nil
end

-- The persistent store's availability (pstore.lua, docs/pstore.md): 'pstore' is DISCONNECTED while persistent work
-- is refused; 'nonew' (OPERATOR or FULL) while only consuming work may enter.
local function disconnected() return redis.call('HGET', META, 'pstore') == 'DISCONNECTED' end
local function pstore_refusal(what)
  return redis.error_reply('PSTORE ' .. what .. ': the persistent store is disconnected (cfemu pstore connect)')
end

-- A 'no new units of work' state that capacity sets (put.lua) holds only while the structure is above this share of
-- one of its limits: it is set only then (a put refused for its own size, in a structure with room, is no reason
-- to stop everyone's new work) and ends once the structure is back at or below it (where entries leave, and at a
-- put), so that it does not flap at the limit. One an operator set ends only by the operator.
local LOW_WATER = 0.8
local function below_low_water()
  local m = redis.call('HMGET', META, 'entries', 'bytes', 'max_entries', 'max_bytes')
  local n, b = tonumber(m[1] or '0'), tonumber(m[2] or '0')
  local maxn, maxb = tonumber(m[3] or '0'), tonumber(m[4] or '0')
  return (maxn == 0 or n <= maxn * LOW_WATER) and (maxb == 0 or b <= maxb * LOW_WATER)
end
local function relieve()
  if below_low_water() then redis.call('HDEL', META, 'nonew') end
end

local function account(entries, bytes)
  redis.call('HINCRBY', META, 'entries', entries)
  redis.call('HINCRBY', META, 'bytes', bytes)
  if entries < 0 and redis.call('HGET', META, 'nonew') == 'FULL' then relieve() end
end

-- The CF's own time (ms since the epoch, Redis TIME), for what must not follow a caller's clock: the backup
-- mark's lease. Read before a script writes, as pclock.lua does (scripts are replicated by their effects).
local function cf_time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The backup mark ('backup', with its lease 'backup_until' in CF time): returns the id of the backup running,
-- or nil and the id of a stale mark. A mark whose lease has ended is stale: its backup died or stalled, it can
-- no longer end well (backup_renew and backup_end refuse it), and every script treats it as absent. A stale
-- mark seen here stays stale (its lease is set to 0), so that a CF clock stepping back cannot revive a backup
-- that a script already treated as gone. A mark without a lease lasts until backup_end or backup_cancel clears it.
local function backup_mark()
  local m = redis.call('HMGET', META, 'backup', 'backup_until')
  if not m[1] then return nil, nil end
  if m[2] and tonumber(m[2]) <= cf_time_ms() then
    if m[2] ~= '0' then redis.call('HSET', META, 'backup_until', '0') end
    return nil, m[1]
  end
  return m[1], nil
end

local function load(id)
  local raw = redis.call('HGET', ENT, id)
  if not raw then return nil end
  return cmsgpack.unpack(raw)
end

local function store(d) redis.call('HSET', ENT, d.id, cmsgpack.pack(d)) end

-- Remove an entry completely (committed get, backed-out put, purge of an expired message).
local function delete_entry(d)
  redis.call('HDEL', ENT, d.id)
  redis.call('HDEL', DATA, d.id)
  redis.call('ZREM', EXPIRY, d.id)
  if d.cid and d.cid ~= '' then redis.call('SREM', ixkey(d.q, 'c', d.cid), d.id) end
  if d.mid and d.mid ~= '' then redis.call('SREM', ixkey(d.q, 'm', d.mid), d.id) end
  account(-1, -(d.len or 0))
end

-- A UOW's standing on this structure: nil when it may go on, else an error reply.
-- gen: 0 on the UOW's first touch of the structure, else the structure generation the UOW started in.
local function uow_standing(uow, gen)
  local t = redis.call('HGET', TOMB, uow)
  if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
  if t == 'C' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was committed by recovery') end
  if t == 'P' then
    return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ': its work on this structure was purged')
  end
  if redis.call('HEXISTS', UOWS, uow) == 0 and tonumber(gen) ~= 0
      and tonumber(gen) ~= tonumber(redis.call('HGET', META, 'gen') or '0') then
    return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was lost with the CF and backed out by restore')
  end
  return nil
end

-- gen (the generation the caller's UOW started in on this structure) is older than the structure's: a restore
-- carried the UOW over (in doubt, or in commit), or it was lost with the CF.
local function carried_over(gen)
  local g = tonumber(gen) or 0
  return g ~= 0 and g ~= tonumber(redis.call('HGET', META, 'gen') or '0')
end

-- May `member` work under `uow` here? nil, or BADUOW when another member's UOW holds entries on the structure.
-- Scripts call it before they change anything (Redis does not roll a script back after an error reply).
local function uow_owner_check(uow, member)
  local raw = redis.call('HGET', UOWS, uow)
  if raw then
    local u = cmsgpack.unpack(raw)
    if u.o ~= member then return redis.error_reply('BADUOW unit of work ' .. uow .. ' belongs to ' .. u.o) end
  end
  return nil
end

local function join_uow(uow, member, lrsn)
  local err = uow_owner_check(uow, member) if err then return err end
  if redis.call('HEXISTS', UOWS, uow) == 1 then return nil end
  redis.call('HSET', UOWS, uow, cmsgpack.pack({o = member, f = lrsn, g = tonumber(redis.call('HGET', META, 'gen') or '0')}))
  return nil
end

-- The length of an entry as a caller must carry it: its data plus its descriptor as stored (bytes).
local function carried_length(id)
  return redis.call('HSTRLEN', DATA, id) + redis.call('HSTRLEN', ENT, id)
end

local function too_long_reply(id, length, max)
  return redis.error_reply(string.format('TOOLONG message %s is %d bytes (data and descriptor); the caller can take %d',
    id, length, max))
end

-- The entries a UOW still holds on this structure: its uncommitted puts and its uncommitted gets.
local function held_entries(uow)
  local puts, gets = {}, {}
  for _, id in ipairs(redis.call('SMEMBERS', uowkey(uow))) do
    local d = load(id)
    if d and d.u == uow then
      if d.st == 'UP' then puts[#puts + 1] = d elseif d.st == 'UG' then gets[#gets + 1] = d end
    end
  end
  return puts, gets
end

local function cur_gen() return tonumber(redis.call('HGET', META, 'gen') or '0') end

-- Get order within a priority: commit lrsn (o1), then put lrsn (o2): the order restore rebuilds
-- (restore.settle.fifo_key), so the order survives a restore. o1 is the LRSN at which the commit counts
-- (commit.lua's counts-at, sqm.core.records.counts_at), the same one restore places the commit at.
local function before(a, b) return a.o1 < b.o1 or (a.o1 == b.o1 and a.o2 < b.o2) end

-- Add a committed entry to its priority list at its place in get order. A commit almost always belongs at the
-- tail, and a backed-out get (its o1 unchanged) at the head; but a commit applied after a later-logged commit,
-- or gets of one list backed out in another order than they were taken, belong further in: walk to the place.
local function make_available(d)
  d.st = 'CP'; d.u = ''
  local k = qkey(d.q, 'cp:' .. d.p)
  local last = redis.call('LINDEX', k, -1)
  local t = last and load(last)
  if not t or not before(d, t) then redis.call('RPUSH', k, d.id) return end
  local n = redis.call('LLEN', k)
  for i = 0, n - 1, 256 do
    for _, id in ipairs(redis.call('LRANGE', k, i, i + 255)) do
      local e = load(id)
      if e and before(d, e) then redis.call('LINSERT', k, 'BEFORE', id, d.id) return end
    end
  end
  redis.call('RPUSH', k, d.id)
end
