-- browse: read available messages of a queue without taking them, in get order (priority, then FIFO).
-- ARGV: 1 queue, 2 max count, 3 now (ms)
-- Returns a flat list {descriptor, data, descriptor, data, ...} of unexpired committed messages.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, limit, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
local out = {}
for p = 9, 0, -1 do
  if #out >= 2 * limit then break end
  for _, id in ipairs(redis.call('LRANGE', qkey(queue, 'cp:' .. p), 0, limit - 1 - #out / 2)) do
    local raw = redis.call('HGET', ENT, id)
    if raw then
      local d = cmsgpack.unpack(raw)
      if not (d.exp and d.exp > 0 and d.exp <= now) then
        out[#out + 1] = raw
        out[#out + 1] = redis.call('HGET', DATA, id)
      end
    end
  end
end
return out
