-- expire: move committed messages whose expiry time has passed to the expired list, then delete what was
-- already on it (the expiry task calls this periodically; the caller logs EXPIRE for persistent ones).
-- A call does at most ARGV[3] units of work (the prelude's "Outcomes in bounded steps": an entry, or SCAN_UNIT list
-- elements that the LREM taking an expired message off its list may scan) and answers more = 1 when it stopped
-- with work left; each call is atomic, and a later call goes on where it stopped (Structure.expire calls again).
-- ARGV: 1 now (ms), 2 max count (of entries due to look at), 3 step (the most units of work; 0: no bound)
-- Returns {expired persistent ids..., '|', purged count, entries due looked at, more (1: call again)}: ids moved to
-- the expired list in this call.
local st = redis.call('HGET', META, 'state')
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. tostring(st)) end
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local budget = budget_of(ARGV[3])
local used, purged, more = 0, 0, 0
for _, queue in ipairs(redis.call('SMEMBERS', QUEUES)) do
  while used < budget do
    local id = redis.call('LPOP', qkey(queue, 'ex'))
    if not id then break end
    used = used + 1
    local d = load(id)
    if d and d.st == 'EX' then delete_entry(d) purged = purged + 1 end
  end
  if used >= budget and redis.call('LLEN', qkey(queue, 'ex')) > 0 then more = 1 end
end
local out = {}
local looked = 0
if used < budget then
  local due = redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(due) do
    if used >= budget then more = 1 break end
    looked = looked + 1
    used = used + 1
    local d = load(id)
    redis.call('ZREM', EXPIRY, id)
    if d and d.st == 'CP' then
      local k = qkey(d.q, 'cp:' .. d.p)
      used = used + math.floor(redis.call('LLEN', k) / SCAN_UNIT)
      redis.call('LREM', k, 1, id)
      d.st = 'EX'
      store(d)
      redis.call('RPUSH', qkey(d.q, 'ex'), id)
      if d.per == 1 then out[#out + 1] = id end
    elseif d and (d.st == 'UP' or d.st == 'UG') then
      -- held by a UOW: look again later, it expires once it is available
      redis.call('ZADD', EXPIRY, now + 1000, id)
    end
  end
  if looked == #due and #due == limit then more = 1 end
else
  more = 1
end
out[#out + 1] = '|'
out[#out + 1] = purged
out[#out + 1] = looked
out[#out + 1] = more
return out
