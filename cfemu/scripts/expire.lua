-- expire: move committed messages whose expiry time has passed to the expired list, then delete what was
-- already on it (the expiry task calls this periodically; the caller logs EXPIRE for persistent ones).
-- ARGV: 1 now (ms), 2 max count
-- Returns {expired persistent ids..., '|', purged count}: ids moved to the expired list in this call.
local st = redis.call('HGET', META, 'state')
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. tostring(st)) end
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local purged = 0
for _, queue in ipairs(redis.call('SMEMBERS', QUEUES)) do
  while true do
    local id = redis.call('LPOP', qkey(queue, 'ex'))
    if not id then break end
    local d = load(id)
    if d and d.st == 'EX' then delete_entry(d) purged = purged + 1 end
  end
end
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', now, 'LIMIT', 0, limit)) do
  local d = load(id)
  redis.call('ZREM', EXPIRY, id)
  if d and d.st == 'CP' then
    redis.call('LREM', qkey(d.q, 'cp:' .. d.p), 1, id)
    d.st = 'EX'
    store(d)
    redis.call('RPUSH', qkey(d.q, 'ex'), id)
    if d.per == 1 then out[#out + 1] = id end
  elseif d and (d.st == 'UP' or d.st == 'UG') then
    -- held by a UOW: look again later, it expires once it is available
    redis.call('ZADD', EXPIRY, now + 1000, id)
  end
end
out[#out + 1] = '|'
out[#out + 1] = purged
return out
