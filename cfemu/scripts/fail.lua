-- fail: an operator's restore or purge of a live structure (--mark-failed) fails it before claiming it, only if it
-- is still the structure the restore saw at its start: ACTIVE, with the restore token and generation given. Its
-- members write the header on every operation while it is ACTIVE, so a claim that watches the header of a busy
-- structure finds it changed every time; once FAILED, every member script refuses work and writes nothing, and
-- the claim (cfemu.bulk.claim) takes it. Compared and set in one call: a restore or a purge that took the
-- structure over meanwhile (another token, generation or state) is left as it is.
-- ARGV: 1 restore token seen, 2 generation seen.
-- Returns 1 when it failed the structure, else {state, restore token, generation} as they are now.
local m = redis.call('HMGET', META, 'state', 'restore_token', 'gen')
if not m[1] then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
if m[1] == 'ACTIVE' and tonumber(m[2] or '0') == tonumber(ARGV[1]) and tonumber(m[3] or '0') == tonumber(ARGV[2]) then
  redis.call('HSET', META, 'state', 'FAILED')
  return 1
end
return {m[1], m[2] or '0', m[3] or '0'}
