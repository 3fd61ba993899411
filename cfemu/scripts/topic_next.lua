-- topic_next: the next publication of a topic after a subscriber's position, without taking it (sqm.pubsub).
-- A topic's publications are the committed entries of its <TOPIC>.PUB queue (priority 0 only), each publication's
-- messages sharing its id as correlation id and the LRSN its publisher's commit counts at (o1). The priority list
-- is in get order, (o1, o2), so commit order: a binary search over LINDEX finds the first entry at or after the
-- position, and the publication after it is the next one in commit order. Publications of two publishers that
-- commit at the same LRSN are ordered by their ids, so a position is (o1, publication id).
-- An open publication (an uncommitted put on the queue) may still commit at an LRSN below a committed one (its
-- COMMIT record is logged before its commit reaches the CF, and another's may overtake it), so a committed
-- publication at or above the lowest put LRSN (o2) of an uncommitted put waits ('W'): a subscriber's position never
-- passes a publication that can still appear below it. A publication with fewer committed messages than its
-- 'pub.count' property is being removed (the sweeper takes its messages): it is skipped, never returned in part.
-- Read only; idempotent.
-- ARGV: 1 queue, 2 position LRSN (o1 of the last publication received; the structure clock at subscribe),
--       3 position publication id (hex; '' = before every publication at that LRSN, '~' = after every one),
--       4 'H' for its head only (optional): what the sweeper needs of a publication, never its data, so that a
--         large publication a subscriber has not received yet costs the CF no more per sweep than a small one
-- Returns {clock, 'P', o1, publication id, descriptor, data, descriptor, data, ...} (its messages in put order),
-- with 'H' {clock, 'P', o1, publication id, message count, descriptor of its first message},
-- {clock, 'W', open} when the next one waits for an open publication, or {clock, 'N'[, open]} when there is none;
-- open: the LRSN of the first put of the open publications (the lowest one can commit above), when there are any:
-- a subscribe starts below it, so that a publication committing below the clock is still after its position.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, pos, pos_pub, head_only = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4] == 'H'
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
if not pos then return redis.error_reply('BADARG position must be an LRSN') end
local clock = tonumber(redis.call('HGET', META, 'clock') or '0')
local clock_s = string.format('%d', clock)

-- The lowest LRSN an open publication can still commit at (above the LRSN of its first put): that of the first of
-- the queue's uncommitted puts, whose list the CF keeps in put order (put.lua appends each with a rising o2, commit
-- and backout only remove, restore loads it in o2 order: restore/settle.load_key), so one read, however many puts
-- are open (a 10,000-message publication being committed).
local horizon = nil
local first_open = redis.call('LINDEX', qkey(queue, 'up'), 0)
if first_open then
  local d = load(first_open)
  if d then horizon = d.o2 end
end

local k = qkey(queue, 'cp:0')
local n = redis.call('LLEN', k)
local lo, hi = 0, n
while lo < hi do  -- the first entry whose o1 is at or above the position
  local mid = math.floor((lo + hi) / 2)
  local d = load(redis.call('LINDEX', k, mid))
  if d and d.o1 < pos then lo = mid + 1 else hi = mid end
end

local function count_of(d)
  local c = d.pr and d.pr['pub.count']
  return tonumber(c) or 1
end

local i = lo
while i < n do
  local first = load(redis.call('LINDEX', k, i))
  local g = first.o1
  if horizon ~= nil and g >= horizon then return {clock_s, 'W', string.format('%d', horizon)} end
  -- the entries committed at LRSN g (one publication, almost always), in list order
  local group, j, done = {}, i, false
  while not done and j < n do
    local ids = redis.call('LRANGE', k, j, j + 255)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      local d = load(id)
      if not d or d.o1 ~= g then done = true break end
      group[#group + 1] = d
      j = j + 1
    end
  end
  local pubs, seen = {}, {}
  for _, d in ipairs(group) do
    local c = d.cid or ''
    if not seen[c] and (g > pos or c > pos_pub) then seen[c] = true pubs[#pubs + 1] = c end
  end
  table.sort(pubs)
  for _, c in ipairs(pubs) do
    local msgs = {}
    for _, d in ipairs(group) do if (d.cid or '') == c then msgs[#msgs + 1] = d end end
    if #msgs == count_of(msgs[1]) then
      local out = {clock_s, 'P', string.format('%d', g), c}
      if head_only then
        out[5] = string.format('%d', #msgs)
        out[6] = cmsgpack.pack(msgs[1])
        return out
      end
      for _, d in ipairs(msgs) do
        out[#out + 1] = cmsgpack.pack(d)
        out[#out + 1] = redis.call('HGET', DATA, d.id)
      end
      return out
    end
  end
  i = j
end
if horizon ~= nil then return {clock_s, 'N', string.format('%d', horizon)} end
return {clock_s, 'N'}
