-- uow_entries: the entries a UOW holds on this structure, with their data (read only).
-- Used to log the data of persistent gets in a BACKOUT record while a backup runs, and by recovery.
-- ARGV: 1 uow
-- Returns a flat list {descriptor, data, ...}.
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', uowkey(ARGV[1]))) do
  local raw = redis.call('HGET', ENT, id)
  if raw then
    out[#out + 1] = raw
    out[#out + 1] = redis.call('HGET', DATA, id) or ''
  end
end
return out
