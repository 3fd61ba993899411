-- _prelude: shared helpers, prepended to every CF script when it is loaded (Redis Lua has no include): this opening
-- comment and the top-level definitions the script uses (cfemu.lua.source; a call runs every definition it is
-- given, so each top-level statement here is a `local` definition).
-- Every script gets the same KEYS, all inside one structure's hash tag {S} (one cluster slot):
--   KEYS[1] {S}:meta    hash  state, gen, clock, floor, backup, backup_until, entries, bytes, max_entries,
--                             max_bytes, pstore, nonew
--   KEYS[2] {S}:fence   hash  member -> epoch (fencing of stale queue managers)
--   KEYS[3] {S}:ent     hash  entry id -> msgpack descriptor
--   KEYS[4] {S}:data    hash  entry id -> message data
--   KEYS[5] {S}:uows    hash  uow id -> msgpack {o = owner member, f = first lrsn, g = gen}
--   KEYS[6] {S}:tomb    hash  uow id -> 'C' | 'B' (an outcome decided by peer recovery or restore), 'P' (the
--                             UOW's work on this structure was discarded by a purge: its outcome is not decided),
--                             or 'A' (a put committed in one operation was applied: put_committed.lua)
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

-- What a call reads of the structure, it reads once: the whole header in one HMGET at the first use of any of its
-- fields (HEADER: every field a script reads through meta()), a UOW's record and tombstone, an entry's descriptor
-- at their first use. Each is kept in step with the call's own writes, so every write of them goes through the
-- helpers here (meta_set / meta_del, join_uow, uow_write, outcome_done, tomb_del, store, delete_entry), and a table
-- they return is the value as this call sees it: change it only to write it. A script may read or write other
-- header fields itself.
local H = {}  -- field -> value (false: absent), once read
local function meta(field)
  local v = H[field]
  if v == nil then
    -- The table is built here, not at every call: a call runs the whole prelude it is given.
    local fields = {'state', 'gen', 'clock', 'floor', 'pstore', 'nonew', 'entries', 'bytes', 'max_entries',
      'max_bytes', 'backup', 'backup_until'}
    local r = redis.call('HMGET', META, unpack(fields))
    for i, f in ipairs(fields) do if H[f] == nil then H[f] = r[i] end end
    v = H[field]
    if v == nil then  -- a field outside the header's usual set
      v = redis.call('HGET', META, field)
      H[field] = v
    end
  end
  return v
end
local function meta_set(...)  -- field, value, ...
  redis.call('HSET', META, ...)
  local a = {...}
  for i = 1, #a, 2 do H[a[i]] = a[i + 1] end
end
local function meta_del(field)
  redis.call('HDEL', META, field)
  H[field] = false
end

-- The structure's Lamport clock: cf = max(cf, caller) + 1; the caller adopts the result.
local function tick(caller)
  local cf = tonumber(meta('clock') or '0')
  local c = tonumber(caller) or 0
  if c > cf then cf = c end
  cf = cf + 1
  meta_set('clock', cf)
  return cf
end

-- Refuse work unless the structure is ACTIVE and the caller's epoch is current.
local function check_ready(member, epoch)
  local st = meta('state')
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
  local floor = tonumber(meta('floor') or '0')
  if lrsn < floor then return redis.error_reply('FLOOR ' .. string.format('%d', floor)) end
  return nil
end

local function capacity_check(entries, bytes)
  local n, b = tonumber(meta('entries') or '0'), tonumber(meta('bytes') or '0')
  local maxn, maxb = tonumber(meta('max_entries') or '0'), tonumber(meta('max_bytes') or '0')
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
local function disconnected() return meta('pstore') == 'DISCONNECTED' end
local function pstore_refusal(what)
  return redis.error_reply('PSTORE ' .. what .. ': the persistent store is disconnected (cfemu pstore connect)')
end

-- A 'no new units of work' state that capacity sets (put.lua) holds only while the structure is above this share of
-- one of its limits: it is set only then (a put refused for its own size, in a structure with room, is no reason
-- to stop everyone's new work) and ends once the structure is back at or below it (where entries leave, and at a
-- put), so that it does not flap at the limit. One an operator set ends only by the operator.
local LOW_WATER = 0.8
local function below_low_water()
  local n, b = tonumber(meta('entries') or '0'), tonumber(meta('bytes') or '0')
  local maxn, maxb = tonumber(meta('max_entries') or '0'), tonumber(meta('max_bytes') or '0')
  return (maxn == 0 or n <= maxn * LOW_WATER) and (maxb == 0 or b <= maxb * LOW_WATER)
end
local function relieve()
  if below_low_water() then meta_del('nonew') end
end

-- Whether a new message of `bytes` may enter (put.lua, put_committed.lua): nil, or the refusal. NONEW while the
-- structure takes no new units of work, FULL past a limit (which sets the "no new units of work" state when the
-- structure, without this message, is above its low-water mark). exempt (optional): a function telling whether
-- this put is a replacement (put.lua), which neither refuses; asked only where a limit or that state could refuse.
local function admit(bytes, exempt)
  local nonew = meta('nonew')
  if nonew == 'FULL' and below_low_water() then  -- capacity's state ends at the mark (a header from before the rule)
    meta_del('nonew')
    nonew = nil
  end
  if exempt and (nonew or meta('max_entries') ~= '0' or meta('max_bytes') ~= '0') and exempt() then return nil end
  if nonew then
    return redis.error_reply('NONEW the structure takes no new units of work (' .. (nonew == 'FULL' and
      'it reached its capacity' or 'set by an operator') .. '): only consuming work is allowed')
  end
  local err = capacity_check(1, bytes)
  if err and not below_low_water() then  -- full because the structure is, not because this one message is too big
    meta_set('nonew', 'FULL')
  end
  return err
end

local function account(entries, bytes)
  meta_set('entries', string.format('%d', tonumber(meta('entries') or '0') + entries),
    'bytes', string.format('%d', tonumber(meta('bytes') or '0') + bytes))
  if entries < 0 and meta('nonew') == 'FULL' then relieve() end
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
  local id, lease = meta('backup'), meta('backup_until')
  if not id then return nil, nil end
  if lease and tonumber(lease) <= cf_time_ms() then
    if lease ~= '0' then meta_set('backup_until', '0') end
    return nil, id
  end
  return id, nil
end

-- Descriptors this call loaded or stored (id -> table, false: no entry), and their stored lengths.
local DESC, DESC_LEN = {}, {}
local function load(id)
  local d = DESC[id]
  if d == nil then
    local raw = redis.call('HGET', ENT, id)
    d = raw and cmsgpack.unpack(raw)
    DESC[id] = d
    if raw then DESC_LEN[id] = #raw end
  end
  return d or nil
end

-- Returns the descriptor as stored (msgpack).
local function store(d)
  local raw = cmsgpack.pack(d)
  redis.call('HSET', ENT, d.id, raw)
  DESC[d.id] = d
  DESC_LEN[d.id] = #raw
  return raw
end

-- Add a new entry (its descriptor d complete: id, queue, length, state) with its data: stored, in the expiry set
-- when it expires, in its queue's correlation-id and message-id indexes, and counted in the structure's totals.
-- The inverse of delete_entry.
local function add_entry(d, data)
  store(d)
  redis.call('HSET', DATA, d.id, data)
  if d.exp and d.exp > 0 then redis.call('ZADD', EXPIRY, d.exp, d.id) end
  if d.cid and d.cid ~= '' then redis.call('SADD', ixkey(d.q, 'c', d.cid), d.id) end
  if d.mid and d.mid ~= '' then redis.call('SADD', ixkey(d.q, 'm', d.mid), d.id) end
  account(1, #data)
end

-- Remove an entry completely (committed get, backed-out put, purge of an expired message). {S}:expiry holds an
-- entry only when its expiry time is above 0.
local function delete_entry(d)
  redis.call('HDEL', ENT, d.id)
  redis.call('HDEL', DATA, d.id)
  DESC[d.id] = false
  DESC_LEN[d.id] = nil
  if d.exp and d.exp > 0 then redis.call('ZREM', EXPIRY, d.id) end
  if d.cid and d.cid ~= '' then redis.call('SREM', ixkey(d.q, 'c', d.cid), d.id) end
  if d.mid and d.mid ~= '' then redis.call('SREM', ixkey(d.q, 'm', d.mid), d.id) end
  account(-1, -(d.len or 0))
end

local function cur_gen() return tonumber(meta('gen') or '0') end

-- A UOW's record in {S}:uows as stored (false: none), and its tombstone (false: none).
local UREC, UTOMB = {}, {}
local function uow_raw(uow)
  local raw = UREC[uow]
  if raw == nil then raw = redis.call('HGET', UOWS, uow) UREC[uow] = raw end
  return raw
end
local function tomb(uow)
  local t = UTOMB[uow]
  if t == nil then t = redis.call('HGET', TOMB, uow) UTOMB[uow] = t end
  return t
end
local function tomb_del(uow)
  redis.call('HDEL', TOMB, uow)
  UTOMB[uow] = false
end

-- A UOW's standing on this structure: nil when it may go on, else an error reply.
-- gen: 0 on the UOW's first touch of the structure, else the structure generation the UOW started in.
local function uow_standing(uow, gen)
  local raw = uow_raw(uow)
  local mark = raw and cmsgpack.unpack(raw).s
  if mark == 'C' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' is being committed') end
  if mark == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' is being backed out') end
  local t = tomb(uow)
  if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
  if t == 'C' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was committed by recovery') end
  if t == 'A' then return redis.error_reply('COMPLETED unit of work ' .. uow .. ' was put and committed') end
  if t == 'P' then
    return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ': its work on this structure was purged')
  end
  if not raw and tonumber(gen) ~= 0 and tonumber(gen) ~= cur_gen() then
    return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was lost with the CF and backed out by restore')
  end
  return nil
end

-- gen (the generation the caller's UOW started in on this structure) is older than the structure's: a restore
-- carried the UOW over (in doubt, or in commit), or it was lost with the CF.
local function carried_over(gen)
  local g = tonumber(gen) or 0
  return g ~= 0 and g ~= cur_gen()
end

-- May `member` work under `uow` here? nil, or BADUOW when another member's UOW holds entries on the structure.
-- Scripts call it before they change anything (Redis does not roll a script back after an error reply).
local function uow_owner_check(uow, member)
  local raw = uow_raw(uow)
  if raw then
    local u = cmsgpack.unpack(raw)
    if u.o ~= member then return redis.error_reply('BADUOW unit of work ' .. uow .. ' belongs to ' .. u.o) end
  end
  return nil
end

local function join_uow(uow, member, lrsn)
  local err = uow_owner_check(uow, member) if err then return err end
  if uow_raw(uow) then return nil end
  local raw = cmsgpack.pack({o = member, f = lrsn, g = cur_gen()})
  redis.call('HSET', UOWS, uow, raw)
  UREC[uow] = raw
  return nil
end

-- The length of an entry as a caller must carry it: its data plus its descriptor as stored (bytes).
local function carried_length(id)
  return redis.call('HSTRLEN', DATA, id) + (DESC_LEN[id] or redis.call('HSTRLEN', ENT, id))
end

-- A reply's pair for one entry: its descriptor and data, or two empty strings for none (peek_many, entry_data).
local function push_pair(out, d)
  out[#out + 1] = d and cmsgpack.pack(d) or ''
  out[#out + 1] = d and (redis.call('HGET', DATA, d.id) or '') or ''
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

-- ---------------------------------------------------------------------------------------------------------------
-- Outcomes in bounded steps (commit.lua, backout.lua; docs/cf-layout.md, "Outcomes in bounded steps").
-- No call holds the CF long, whatever the UOW's size: a call handles at most `budget` units of work, a unit being
-- one entry, or 1024 list elements that a list command may scan for it; then it answers 'more' and the caller
-- calls again. A UOW holding no more entries than the budget is done in one call, as it always was. A larger one is
-- marked in its record in {S}:uows by its first call: s = 'C' (committing) or 'B' (backing out), a = the LRSN its
-- entries are stamped with, k = 1 when a restore carried it into this generation, c = the cursor over its set while
-- its work sets are filled, w = 1 once they are. The mark is the decision on this structure: every later call of
-- either outcome for the UOW, by any member, finishes the outcome begun (a backout of a committing UOW finishes its
-- commit: puts made available cannot be taken back; a commit of a UOW being backed out is refused as backed out:
-- puts deleted cannot be made available), and no put or get may join the UOW any more (uow_standing). Each call is
-- atomic and leaves the structure consistent (every entry wholly in its old state or its new one), so a caller that
-- dies between calls leaves a half-applied outcome that the next call for the UOW (recovery, a restart, a retry)
-- finishes. The work sets hold what is left, in the order it is done: puts by put LRSN (commit: they become
-- available in put order), gets by get LRSN (their list order).
local function uow_record(uow)  -- decoded afresh: the caller may change it to write it
  local raw = uow_raw(uow)
  return raw and cmsgpack.unpack(raw)
end
local function uow_write(uow, rec)
  local raw = cmsgpack.pack(rec)
  redis.call('HSET', UOWS, uow, raw)
  UREC[uow] = raw
end
local function workkey(uow, kind) return PREFIX .. 'uow' .. kind .. ':' .. uow end  -- kind 'p' puts, 'g' gets

-- The structure's state only, not the caller's epoch: the steps of an outcome begun are finished by any caller.
local function check_state()
  local st = meta('state')
  if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
  if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
  return nil
end

local SCAN_UNIT = 1024  -- list elements a command may scan, counted as one unit of work

-- Lua cannot unpack an unbounded table into one call: push ids in chunks.
local function push_ids(cmd, k, ids)
  for i = 1, #ids, 4000 do
    redis.call(cmd, k, unpack(ids, i, math.min(#ids, i + 3999)))
  end
end

-- The first index of list k whose entry comes after d in get order (the list is in get order): a binary search.
local function place_index(k, d, n)
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local e = load(redis.call('LINDEX', k, mid))
    if e and before(d, e) then hi = mid else lo = mid + 1 end
  end
  return lo
end

-- Make d available at its place in get order; its cost in units. The ends are checked first (a commit belongs at
-- the tail, a backed-out get at the head); else the place is found by binary search and LINSERT scans to it.
local function place(d)
  d.st = 'CP'; d.u = ''
  local k = qkey(d.q, 'cp:' .. d.p)
  local last = redis.call('LINDEX', k, -1)  -- none: the list is empty
  local t = last and load(last)
  if not t or not before(d, t) then redis.call('RPUSH', k, d.id) return 1 end
  local h = load(redis.call('LINDEX', k, 0))
  if h and before(d, h) then redis.call('LPUSH', k, d.id) return 1 end
  local i = place_index(k, d, redis.call('LLEN', k))
  redis.call('LINSERT', k, 'BEFORE', redis.call('LINDEX', k, i), d.id)
  return 1 + math.floor(i / SCAN_UNIT)
end

-- Puts of one commit (all stamped with the same LRSN), in put order, made available. Where entries that come
-- after them are at the tail of a list already (a commit that counts later applied first, or between two steps),
-- that tail is set aside once (at most `budget` entries), the puts go behind what is left, and the tail is put back
-- after them (merged in get order): a few list operations per step instead of one scan of the list per put.
-- Returns the units used, and how many of `ids` (in order) were handled (the rest is for the next call).
local function commit_puts(uow, ids, at, budget, used, seg_max)
  local aside = {}  -- list -> {seg = entries set aside, ours = puts to go before them}
  local lists = {}
  local handled, made = 0, 0
  for _, id in ipairs(ids) do
    if used >= budget and handled > 0 then break end
    handled = handled + 1
    used = used + 1
    local d = load(id)
    if d and d.u == uow and d.st == 'UP' then
      redis.call('LREM', qkey(d.q, 'up'), 1, d.id)
      d.l = at; d.o1 = at; d.st = 'CP'; d.u = ''
      store(d)
      made = made + 1
      local k = qkey(d.q, 'cp:' .. d.p)
      local a = aside[k]
      if a then
        a.ours[#a.ours + 1] = d
      else
        local last = redis.call('LINDEX', k, -1)  -- none: the list is empty
        local t = last and load(last)
        if not t or not before(d, t) then
          redis.call('RPUSH', k, d.id)
        else
          local n = redis.call('LLEN', k)
          local i = place_index(k, d, n)
          used = used + math.floor(math.log(n + 1) / math.log(2))
          if n - i <= seg_max then
            local seg = {}
            for _, sid in ipairs(redis.call('LRANGE', k, i, -1)) do
              seg[#seg + 1] = load(sid) or {id = sid, o1 = 0, o2 = 0}
            end
            if i == 0 then redis.call('DEL', k) else redis.call('LTRIM', k, 0, i - 1) end
            used = used + #seg
            aside[k] = {seg = seg, ours = {d}}
            lists[#lists + 1] = k
          else
            redis.call('LINSERT', k, 'BEFORE', redis.call('LINDEX', k, i), d.id)
            used = used + math.floor(i / SCAN_UNIT)
          end
        end
      end
    end
  end
  for _, k in ipairs(lists) do
    local a = aside[k]
    local merged, i, j = {}, 1, 1
    while i <= #a.ours or j <= #a.seg do
      if j > #a.seg or (i <= #a.ours and not before(a.seg[j], a.ours[i])) then
        merged[#merged + 1] = a.ours[i].id; i = i + 1
      else
        merged[#merged + 1] = a.seg[j].id; j = j + 1
      end
    end
    push_ids('RPUSH', k, merged)
  end
  return used, handled, made
end

-- Entries a UOW holds in state st ('UG': the gets of a commit, in get order; 'UP': the puts of a backout, in put
-- order), deleted: each LREM of its uncommitted list (list: 'ug' or 'up') finds its entry near the head.
local function delete_held(uow, ids, budget, used, st, list)
  local handled, deleted = 0, 0
  for _, id in ipairs(ids) do
    if used >= budget and handled > 0 then break end
    handled = handled + 1
    used = used + 1
    local d = load(id)
    if d and d.u == uow and d.st == st then
      redis.call('LREM', qkey(d.q, list), 1, d.id)
      delete_entry(d)
      deleted = deleted + 1
    end
  end
  return used, handled, deleted
end

-- Gets of a backout, newest first (each goes back to the head of its list, at its place in get order, its backout
-- count raised), LREM from the tail of the gets' list.
local function backout_gets(uow, ids, at, budget, used)
  local handled, back = 0, 0
  for _, id in ipairs(ids) do
    if used >= budget and handled > 0 then break end
    handled = handled + 1
    local d = load(id)
    if d and d.u == uow and d.st == 'UG' then
      redis.call('LREM', qkey(d.q, 'ug'), -1, d.id)
      d.bc = (d.bc or 0) + 1
      d.l = at
      used = used + place(d)
      store(d)
      back = back + 1
    else
      used = used + 1
    end
  end
  return used, handled, back
end

-- While a backup runs, a persistent get may only be backed out by a record that carries its data (backout.lua).
local function gets_need_data(ids, has_data)
  if has_data or not backup_mark() then return false end
  for _, id in ipairs(ids) do
    local d = load(id)
    if d and d.st == 'UG' and d.per == 1 then return true end
  end
  return false
end

-- The UOW's entries, split and ordered for its outcome: puts by put LRSN, gets by get LRSN (newest first for a
-- backout).
local function ordered_entries(uow, kind)
  local puts, gets = held_entries(uow)
  table.sort(puts, function(a, b) return a.o2 < b.o2 end)
  if kind == 'C' then table.sort(gets, function(a, b) return a.l < b.l end)
  else table.sort(gets, function(a, b) return a.l > b.l end) end
  local p, g = {}, {}
  for _, d in ipairs(puts) do p[#p + 1] = d.id end
  for _, d in ipairs(gets) do g[#g + 1] = d.id end
  return p, g
end

-- The end of an outcome on this structure: the UOW no longer holds anything here.
local function outcome_done(uow, kind, record)
  redis.call('DEL', uowkey(uow), workkey(uow, 'p'), workkey(uow, 'g'))
  redis.call('HDEL', UOWS, uow)
  UREC[uow] = false
  if record then
    redis.call('HSET', TOMB, uow, kind)
    UTOMB[uow] = kind
  end
end

-- An outcome small enough for one call: the whole of it, now. Returns {puts, gets}; nil and an error reply when a
-- backout needs the data of its gets logged.
local function outcome_whole(uow, kind, at, has_data, budget)
  local p, g = ordered_entries(uow, kind)
  local inf = math.huge
  if kind == 'C' then
    local _, _, made = commit_puts(uow, p, at, inf, 0, budget)
    local _, _, deleted = delete_held(uow, g, inf, 0, 'UG', 'ug')
    return {made, deleted}
  end
  if gets_need_data(g, has_data) then return nil end
  local _, _, deleted = delete_held(uow, p, inf, 0, 'UP', 'up')
  local _, _, back = backout_gets(uow, g, at, inf, 0)
  return {deleted, back}
end

-- One step of a marked outcome (rec: the UOW's record with its mark). Returns {puts, gets, more}, or nil when a
-- backout needs the data of its gets logged (nothing done in this call).
local function outcome_step(uow, rec, budget, has_data, record)
  local used, a, b = 0, 0, 0
  local pk, gk = workkey(uow, 'p'), workkey(uow, 'g')
  local done = {}
  local function took(ids, n) for i = 1, n do done[#done + 1] = ids[i] end end
  while rec.w ~= 1 and used < budget do  -- fill the work sets from the UOW's set
    local r = redis.call('SSCAN', uowkey(uow), rec.c, 'COUNT', math.max(16, budget - used))
    for _, id in ipairs(r[2]) do
      used = used + 1
      local d = load(id)
      if d and d.u == uow then
        if d.st == 'UP' then redis.call('ZADD', pk, d.o2, id)
        elseif d.st == 'UG' then redis.call('ZADD', gk, d.l, id) end
      end
    end
    rec.c = r[1]
    if r[1] == '0' then rec.w = 1 end
  end
  if rec.w == 1 and used < budget then
    local room = budget - used
    if rec.s == 'C' then
      local ids = redis.call('ZRANGE', pk, 0, room - 1)
      local handled
      used, handled, a = commit_puts(uow, ids, rec.a, budget, used, budget)
      if handled > 0 then redis.call('ZREMRANGEBYRANK', pk, 0, handled - 1) took(ids, handled) end
      if used < budget then
        ids = redis.call('ZRANGE', gk, 0, budget - used - 1)
        used, handled, b = delete_held(uow, ids, budget, used, 'UG', 'ug')
        if handled > 0 then redis.call('ZREMRANGEBYRANK', gk, 0, handled - 1) took(ids, handled) end
      end
    else
      local gets = redis.call('ZREVRANGE', gk, 0, room - 1)
      if gets_need_data(gets, has_data) then return nil end
      local ids = redis.call('ZRANGE', pk, 0, room - 1)
      local handled
      used, handled, a = delete_held(uow, ids, budget, used, 'UP', 'up')
      if handled > 0 then redis.call('ZREMRANGEBYRANK', pk, 0, handled - 1) took(ids, handled) end
      if used < budget then
        gets = redis.call('ZREVRANGE', gk, 0, budget - used - 1)
        used, handled, b = backout_gets(uow, gets, rec.a, budget, used)
        if handled > 0 then redis.call('ZREMRANGEBYRANK', gk, -handled, -1) took(gets, handled) end
      end
    end
  end
  if #done > 0 then push_ids('SREM', uowkey(uow), done) end  -- the set shrinks as the work is done
  if rec.w == 1 and redis.call('EXISTS', pk) == 0 and redis.call('EXISTS', gk) == 0 then
    outcome_done(uow, rec.s, record or rec.k == 1)
    return {a, b, 0}
  end
  uow_write(uow, rec)
  return {a, b, 1}
end

-- Begin an outcome on this structure: the whole of it when the UOW holds at most `budget` entries, else the mark
-- and the first step. Returns as outcome_step.
local function outcome_begin(uow, kind, at, carried, budget, has_data, record)
  if redis.call('SCARD', uowkey(uow)) <= budget then
    local r = outcome_whole(uow, kind, at, has_data, budget)
    if not r then return nil end
    outcome_done(uow, kind, record or carried)
    return {r[1], r[2], 0}
  end
  local rec = uow_record(uow) or {o = '', f = 0, g = cur_gen()}
  rec.s = kind; rec.a = at; rec.k = carried and 1 or 0; rec.c = '0'; rec.w = 0
  return outcome_step(uow, rec, budget, has_data, record)
end

-- A step's budget from the caller (ARGV): a positive number of units, else no bound.
local function budget_of(arg)
  local b = tonumber(arg or '0') or 0
  if b <= 0 then return math.huge end
  return b
end

-- A commit's call (commit.lua; get_committed.lua applies the commits it carries): `a` as commit.lua's ARGV.
local function commit_call(a)
  local uow = a[4]
  local lrsn = tonumber(a[6])
  local at = tonumber(a[8] or '0')
  local budget = budget_of(a[10])
  local err
  local rec = uow_record(uow)
  if rec and rec.s then  -- an outcome begun in steps: finish it, whoever calls
    err = check_state() if err then return err end
    if rec.s == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' is being backed out') end
    if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
    local cf = tick(math.max(tonumber(a[3]), lrsn))
    local r = outcome_step(uow, rec, budget, true, a[7] == '1')
    return {cf, r[1], r[2], r[3]}
  end
  if a[9] == '1' then  -- the commit this caller began is finished here
    err = check_state() if err then return err end
    if tomb(uow) == 'C' and not carried_over(a[5]) then tomb_del(uow) end
    return {tick(a[3]), 0, 0, 0}
  end
  err = check_ready(a[1], a[2]) if err then return err end
  local t = tomb(uow)
  if t == 'B' then return redis.error_reply('BACKEDOUT unit of work ' .. uow .. ' was backed out by recovery') end
  if t == 'C' then
    if not carried_over(a[5]) then tomb_del(uow) end
    return {tick(a[3]), 0, 0, 0}
  end
  -- A purge discarded its work here, or the UOW is a put committed in one operation (put_committed.lua), applied:
  -- the outcome stands.
  if t == 'P' or t == 'A' then return {tick(a[3]), 0, 0, 0} end
  if lrsn > 0 then err = floor_check(lrsn) if err then return err end end
  err = uow_standing(uow, a[5]) if err then return err end
  local carried = carried_over(a[5]) and uow_raw(uow) ~= false
  local cf = tick(math.max(tonumber(a[3]), lrsn))
  if lrsn == 0 then lrsn = cf end
  if at == 0 then at = lrsn end
  local r = outcome_begin(uow, 'C', at, carried, budget, true, a[7] == '1')
  return {cf, r[1], r[2], r[3]}
end

-- A get's call (get.lua, get_committed.lua): `a` as get.lua's ARGV; returns as get.lua.
local function take(a)
  local err = check_ready(a[1], a[2]) if err then return err end
  local queue, uow, match, value = a[6], a[4], a[7], a[8]
  local now = tonumber(a[9])
  local max_length = tonumber(a[10] or '0') or 0
  local budget = budget_of(a[11])
  if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
  err = uow_standing(uow, a[5]) if err then return err end
  err = uow_owner_check(uow, a[1]) if err then return err end

  local function expire(d)
    d.st = 'EX'
    store(d)
    redis.call('RPUSH', qkey(queue, 'ex'), d.id)
  end
  local function live(d) return not (d.exp and d.exp > 0 and d.exp <= now) end

  -- The highest priority at or below `top` whose list holds an entry (Redis deletes an empty list), and its list; nil
  -- when there is none. EXISTS counts the lists that exist among those it is given: one over all of them, one over
  -- all but the lowest (priority 0, the usual one), then a binary search over the rest.
  local function highest(top)
    local ks = {}
    for p = top, 0, -1 do ks[#ks + 1] = qkey(queue, 'cp:' .. p) end
    if redis.call('EXISTS', unpack(ks)) == 0 then return nil end
    local lo, hi = 1, #ks
    if hi > 1 then
      if redis.call('EXISTS', unpack(ks, 1, hi - 1)) == 0 then lo = hi else hi = hi - 1 end
    end
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if redis.call('EXISTS', unpack(ks, lo, mid)) > 0 then hi = mid else lo = mid + 1 end
    end
    return top - lo + 1, ks[lo]
  end

  -- Find the message without taking it: the head of the highest non-empty priority list, or the best match.
  -- The match's index holds only the messages with that id: its walk is bounded by them, not by the queue.
  local found, head_of
  local used, again = 0, false  -- expired messages moved from the heads; the step ran out before a live one
  if match == '' then
    local top = 9
    while not found and not again and top >= 0 do
      local p, k = highest(top)
      if not p then break end
      while true do
        local id = redis.call('LINDEX', k, 0)
        if not id then break end
        local d = load(id)
        if d and live(d) then found, head_of = d, k break end
        if used >= budget then again = true break end
        used = used + 1
        redis.call('LPOP', k)
        if d then expire(d) end
      end
      top = p - 1
    end
  else
    for _, id in ipairs(redis.call('SMEMBERS', ixkey(queue, match, value))) do
      local d = load(id)
      if d and d.st == 'CP' then
        if not live(d) then
          redis.call('LREM', qkey(queue, 'cp:' .. d.p), 1, id)
          expire(d)
        elseif not found or d.p > found.p or (d.p == found.p and before(d, found)) then
          found = d
        end
      end
    end
  end

  if again then return {tonumber(meta('clock') or '0'), cur_gen(), 1} end
  if found and found.per == 1 and disconnected() then
    return pstore_refusal('message ' .. found.id .. ' on ' .. queue .. ' is persistent and cannot be taken')
  end
  if found and max_length > 0 then
    local length = carried_length(found.id)
    if length > max_length then return too_long_reply(found.id, length, max_length) end
  end

  local cf = tick(a[3])
  if not found then return {cf, cur_gen()} end
  join_uow(uow, a[1], cf)  -- cannot refuse: the owner was checked above
  if head_of then
    redis.call('LPOP', head_of)  -- found is that list's head
  else
    redis.call('LREM', qkey(queue, 'cp:' .. found.p), 1, found.id)
  end
  found.st = 'UG'; found.u = uow; found.l = cf
  local desc = store(found)
  redis.call('RPUSH', qkey(queue, 'ug'), found.id)
  redis.call('SADD', uowkey(uow), found.id)
  return {cf, cur_gen(), desc, redis.call('HGET', DATA, found.id)}
end
