-- browse: read available messages of a queue without taking them, in get order (priority, then FIFO), a page at a
-- time. Bounded by a count and, for a caller that must carry the reply (a frame), by bytes: each message costs its
-- data plus its descriptor as stored plus ARGV[5]. A browse is a run of calls, each going on from the cursor the
-- last one returned, until the count or the bytes are reached or the cursor says the queue's end was reached.
-- One call visits at most ARGV[9] entries (expired ones count: a queue of a million expired messages costs one call
-- no more than a page of live ones) and carries at most ARGV[10] bytes (the first message of a call is carried
-- whatever its length), so that no browse holds the CF, which runs one script at a time, for longer than a page
-- (the prelude's "Outcomes in bounded steps").
-- Read only. Refuses with TOOLONG when even the browse's first message does not fit.
-- The cursor is "p:i" or "p:i:o1:o2:id": the priority list the next call reads, the position in it to read from,
-- and the order (commit LRSN, put LRSN) and id of the last entry visited in it. When that entry is still just
-- before the position, the next call goes on from there (entries of equal order, which a list may hold, are not
-- skipped at a page's end). Else entries before the position were taken or added between the calls, and the next
-- call finds its place again by the order (a list is kept in order): the first entry after it. An entry there for
-- the whole browse is returned once; one that comes or goes meanwhile may or may not be.
-- ARGV: 1 queue, 2 max count, 3 now (ms), 4 max bytes (0 or absent = any), 5 bytes each message costs beyond its
--       data and descriptor (0 or absent = none), 6 cursor ('' or absent: the queue's head), 7 messages the
--       browse's earlier calls returned, 8 bytes they took of ARGV[4], 9 the most entries this call visits,
--       10 the most bytes (data and descriptor) this call carries (9 and 10: 0 or absent = no bound)
-- Returns {more (1 when an available message was left out by the count or the bytes, else 0), cursor ('' at the
-- queue's end), descriptor, data, descriptor, data, ...} of unexpired committed messages.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, limit, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, each = tonumber(ARGV[4] or '0') or 0, tonumber(ARGV[5] or '0') or 0
local cursor = ARGV[6] or ''
local n, used = tonumber(ARGV[7] or '0') or 0, tonumber(ARGV[8] or '0') or 0
local visits, page_bytes = budget_of(ARGV[9]), budget_of(ARGV[10])
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
local top, from, last1, last2, last_id = 9, 0, nil, nil, nil
if cursor ~= '' then
  local p, i, o1, o2, id = string.match(cursor, '^(%d):(%d+):?(%-?%d*):?(%-?%d*):?(.*)$')
  if not p then return redis.error_reply('BADARG cursor ' .. cursor) end
  top, from = tonumber(p), tonumber(i)
  if o1 ~= '' and o2 ~= '' then last1, last2 = tonumber(o1), tonumber(o2) end
  if id ~= '' then last_id = id end
end

-- Whether entry d comes after the last one visited, in get order.
local function after_last(d)
  local o1, o2 = d.o1 or 0, d.o2 or 0
  return o1 > last1 or (o1 == last1 and o2 > last2)
end

-- The position in list k to go on from: the first entry after the last one visited. The cursor's position when it
-- still is (nothing before it was taken or added), else found by a binary search on the list's order.
local function resume(k, i)
  local len = redis.call('LLEN', k)
  if i > len then i = len end
  local prev = i > 0 and load(redis.call('LINDEX', k, i - 1))
  if prev and last_id and prev.id == last_id then return i end
  local here = i < len and load(redis.call('LINDEX', k, i))
  if not (prev and after_last(prev)) and not (here and not after_last(here)) then return i end
  local lo, hi = 0, len
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local d = load(redis.call('LINDEX', k, mid))
    if d and after_last(d) then hi = mid else lo = mid + 1 end
  end
  return lo
end

local out, visited, carried, page_n, more = {0, ''}, 0, 0, 0, 0
local CHUNK = 100
for p = top, 0, -1 do
  local k = qkey(queue, 'cp:' .. p)
  local at = 0
  if p == top then
    at = last1 and resume(k, from) or from
  else
    last1, last2, last_id = nil, nil, nil
  end
  local stop = false
  while not stop do
    local ids = redis.call('LRANGE', k, at, at + CHUNK - 1)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      if visited >= visits then stop = true break end
      visited = visited + 1
      local raw = redis.call('HGET', ENT, id)
      local d = raw and cmsgpack.unpack(raw)
      if d and not (d.exp and d.exp > 0 and d.exp <= now) then
        if n >= limit then more = 1 stop = true break end
        local length = redis.call('HSTRLEN', DATA, id) + #raw
        if budget > 0 and used + length + each > budget then
          if n == 0 then return too_long_reply(id, length, budget - each) end
          more = 1 stop = true break
        end
        if page_n > 0 and carried + length > page_bytes then stop = true break end
        used, carried, n, page_n = used + length + each, carried + length, n + 1, page_n + 1
        out[#out + 1] = raw
        out[#out + 1] = redis.call('HGET', DATA, id)
      end
      if d then last1, last2, last_id = d.o1 or 0, d.o2 or 0, d.id end
      at = at + 1
    end
  end
  if stop then
    out[1] = more
    out[2] = string.format('%d:%d', p, at) .. (last1 and string.format(':%.0f:%.0f:%s', last1, last2, last_id or '')
      or '')
    return out
  end
end
return out
