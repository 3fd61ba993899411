-- browse: read available messages of a queue without taking them, in get order (priority, then FIFO).
-- Bounded by a count and, for a caller that must carry the reply (a frame), by bytes: each message costs its data
-- plus its descriptor as stored plus ARGV[5]. It returns as many messages as fit and says whether more were left.
-- Read only. Refuses with TOOLONG when even the first message does not fit.
-- ARGV: 1 queue, 2 max count, 3 now (ms), 4 max bytes (0 or absent = any), 5 bytes each message costs beyond its
--       data and descriptor (0 or absent = none)
-- Returns {more (1 when an available message was left out, else 0), descriptor, data, descriptor, data, ...}
-- of unexpired committed messages.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
local queue, limit, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local budget, each = tonumber(ARGV[4] or '0') or 0, tonumber(ARGV[5] or '0') or 0
if redis.call('SISMEMBER', QUEUES, queue) == 0 then return redis.error_reply('NOQUEUE ' .. queue) end
local out, n, used, more = {0}, 0, 0, 0
local CHUNK = 100
for p = 9, 0, -1 do
  local k = qkey(queue, 'cp:' .. p)
  local at = 0
  while more == 0 do
    local ids = redis.call('LRANGE', k, at, at + CHUNK - 1)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      local raw = redis.call('HGET', ENT, id)
      if raw then
        local d = cmsgpack.unpack(raw)
        if not (d.exp and d.exp > 0 and d.exp <= now) then
          if n >= limit then more = 1 break end
          if budget > 0 then
            local length = carried_length(id)
            if used + length + each > budget then
              if n == 0 then return too_long_reply(id, length, budget - each) end
              more = 1 break
            end
            used = used + length + each
          end
          out[#out + 1] = raw
          out[#out + 1] = redis.call('HGET', DATA, id)
          n = n + 1
        end
      end
    end
    at = at + CHUNK
  end
  if more == 1 then break end
end
out[1] = more
return out
