-- member_uows: the UOWs a member holds on this structure (peer recovery and restart find in-flight work here,
-- including puts and gets that reached the CF but not the member's log).
-- ARGV: 1 member
-- Returns a flat list {uow id, info (msgpack {o, f, g}), ...}.
local out = {}
local all = redis.call('HGETALL', UOWS)
for i = 1, #all, 2 do
  local u = cmsgpack.unpack(all[i + 1])
  if u.o == ARGV[1] then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
