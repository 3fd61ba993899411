-- One batch of a restore's load (cfemu.bulk.Owner.load), applied only while the structure is that restore's: the
-- header's restore token is ARGV[1] and its state RECOVERING. The check and the writes are one atomic step in the
-- CF, so a load may send its next batch before this one's reply is back: a batch that reaches the CF after another
-- restore or a purge claimed the structure writes nothing (a guard read by the client, then MULTI, could not say so
-- before the batch was sent). The CF's server module runs it as CF.LOAD (cfemu/_cfmodule.c); this script is its
-- specification (tests/cfemu/test_load_command.py holds the module to it).
--
-- KEYS[1] the structure's header, {S}:meta (META; the other KEYS of the prelude are not given). ARGV[1] the restore
-- token. ARGV[2] the batch's writes in RESP, as a client sends commands (arrays of bulk strings): HSET, SADD, RPUSH
-- or ZADD (integer scores), each on a key of this structure (its "{S}:" prefix) of the command's type or none, of
-- at most 4096 arguments (what Lua can unpack into one call; a load's batch of up to 2,047 entries fits). Every
-- command is checked before the first is applied: a batch refused is refused whole. Returns how many commands it
-- applied. A header without a state (flushed, a CF restarted empty) answers NOHEADER: the CF was lost, not taken
-- over.
if string.sub(META, 1, 1) ~= '{' or string.sub(META, -6) ~= '}:meta' or #META < 8 then
  return redis.error_reply('ERR CF.LOAD: the first key is not a structure\'s header ({S}:meta)')
end
local held_meta = redis.call('TYPE', META)['ok']
if held_meta ~= 'hash' and held_meta ~= 'none' then
  return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
end
local h = redis.call('HMGET', META, 'restore_token', 'state')
if not h[2] then
  return redis.error_reply('NOHEADER the structure\'s header is gone from the CF (flushed, or a CF restarted empty)')
end
if h[1] ~= ARGV[1] then
  return redis.error_reply('NOTOWNER the structure\'s restore token is ' .. (h[1] or 'none') .. ', not this load\'s')
end
if h[2] ~= 'RECOVERING' then
  return redis.error_reply('NOTOWNER the structure is ' .. h[2] .. ', not RECOVERING')
end

local prefix = string.sub(META, 1, #META - 4)
local types = {HSET = 'hash', SADD = 'set', RPUSH = 'list', ZADD = 'zset'}
local blob = ARGV[2]
local function bad(why)
  return redis.error_reply('ERR CF.LOAD: ' .. why)
end

local commands, made, pos, size = {}, {}, 1, #blob
while pos <= size do
  local count, at = string.match(blob, '^%*(%d+)\r\n()', pos)
  count = tonumber(count)
  if not count or count < 3 then
    return bad('the commands are not RESP arrays of at least three bulk strings')
  end
  if count > 4096 then
    return bad('a command of more than 4096 arguments')
  end
  local args = {}
  pos = at
  for i = 1, count do
    local len, start = string.match(blob, '^%$(%d+)\r\n()', pos)
    len = tonumber(len)
    if not len or start + len + 1 > size or string.sub(blob, start + len, start + len + 1) ~= '\r\n' then
      return bad('the commands are not RESP arrays of at least three bulk strings')
    end
    args[i] = string.sub(blob, start, start + len - 1)
    pos = start + len + 2
  end
  local name = string.upper(args[1])
  local want = types[name]
  if not want then
    return bad('a load writes by HSET, SADD, RPUSH or ZADD only')
  end
  if (name == 'HSET' or name == 'ZADD') and count % 2 ~= 0 then
    return bad(name .. ' needs its fields and values in pairs')
  end
  if name == 'ZADD' then
    for i = 3, count, 2 do
      if not string.match(args[i], '^%-?%d+$') or #args[i] > 18 then
        return bad('ZADD\'s scores are integers')
      end
    end
  end
  if string.sub(args[2], 1, #prefix) ~= prefix then
    return bad('a key outside the structure')
  end
  -- a key this batch makes has the type of the command that makes it
  local held = made[args[2]] or redis.call('TYPE', args[2])['ok']
  if held ~= 'none' and held ~= want then
    return bad(name .. ' on a key that holds a ' .. held)
  end
  made[args[2]] = want
  args[1] = name
  commands[#commands + 1] = args
end

for _, args in ipairs(commands) do
  redis.call(unpack(args))
end
return #commands
