-- pstore: read or change the availability of the structure's persistent store (docs/pstore.md; EntireX's
-- DISCONNECT-PSTORE / CONNECT-PSTORE and the "no new units of work" state). Two fields of the header {S}:meta:
--   pstore  'DISCONNECTED' while persistent work is refused (absent: connected). put.lua refuses a persistent put,
--           get.lua the get of a persistent message, standing.lua says 'D' for a UOW held here (its member backs it
--           out instead of forcing its COMMIT; a commit decided already completes), and pclock.lua stops the
--           pseudo-clock (no timeout processing).
--   nonew   'OPERATOR' (set here) or 'FULL' (set by put.lua when the structure, above its low-water mark, refuses a
--           put for capacity): only consuming work enters (put.lua refuses every put but the replacement of an
--           entry its UOW takes); 'FULL' is cleared at or below the low-water mark (the prelude's account(), put.lua).
--   started 'WARM' while the structure runs from a WARM start (restore/start_modes.py): it cannot be connected,
--           only started HOT (restored) or COLD (purged), so that a later restore loses no committed work; nor
--           backed up (backup_begin.lua).
-- A flag, not a state: the structure stays ACTIVE (non-persistent work goes on), and a restore or a purge, which
-- replace the whole header (cfemu.bulk.activate), start it connected again.
-- Idempotent: each action sets what it names; 'status' changes nothing. Changes need an ACTIVE structure.
-- ARGV: 1 action: 'status' | 'disconnect' | 'connect' | 'nonew-on' | 'nonew-off'
-- Returns {state, 'CONNECTED' | 'DISCONNECTED', nonew ('' | 'OPERATOR' | 'FULL'), started ('' | 'WARM')}.
local st = redis.call('HGET', META, 'state')
if not st then return redis.error_reply('NOSTRUCT structure is not in the CF (never defined, or the CF was lost)') end
local action = ARGV[1]
if action ~= 'status' then
  if st ~= 'ACTIVE' then return redis.error_reply('CFSTATE structure is ' .. st) end
  if action == 'disconnect' then
    redis.call('HSET', META, 'pstore', 'DISCONNECTED')
  elseif action == 'connect' then
    if redis.call('HGET', META, 'started') == 'WARM' then
      return redis.error_reply('BADARG the structure was started WARM: start it HOT (restore its content) or COLD '
        .. '(empty) to connect its persistent store')
    end
    redis.call('HDEL', META, 'pstore')
  elseif action == 'nonew-on' then
    redis.call('HSET', META, 'nonew', 'OPERATOR')
  elseif action == 'nonew-off' then
    redis.call('HDEL', META, 'nonew')
  else
    return redis.error_reply('BADARG pstore action must be status, disconnect, connect, nonew-on or nonew-off, not '
      .. action)
  end
end
local m = redis.call('HMGET', META, 'state', 'pstore', 'nonew', 'started')
return {m[1], m[2] or 'CONNECTED', m[3] or '', m[4] or ''}
