-- get_committed: a get, and the commits of the caller's earlier gets, as one operation. A get's commit cannot be
-- applied in the call that takes the message: the message's GET record and its forced COMMIT can only be written
-- once the CF has said which message it is, and a message deleted before they are on disk would be lost if the
-- member failed in between (the application never had it). So a member that forced the COMMIT of a UOW holding one
-- get hands that commit to its next call here, which applies it (commit.lua's first call, the same rules) before
-- it takes the next message: a lifecycle of gets costs one CF call per message. Meanwhile the committed get holds
-- its entry as any uncommitted get does (no other get can take it), and peer recovery or a restart finds its COMMIT
-- without an END and completes it (commit.lua), as for any UOW whose member failed before the CF took its commit.
-- The get itself is get.lua's, with its refusals; a refusal of the get does not undo the commits applied before it.
-- ARGV: 1-11 as get.lua's; then, for each commit carried, four: uow, uow gen, commit lrsn (the COMMIT record's),
--       counts-at lrsn (0: the commit lrsn), as commit.lua's ARGV 4, 5, 6 and 8.
-- Returns {done, got}: done holds, per commit carried and in order, 'OK' (applied), 'MORE' (begun, too large for
-- one call: finish it with commit.lua) or the refusal commit.lua would give (e.g. 'FLOOR n': log it again); got
-- is get.lua's reply, or the refusal of the get (a string).
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local done = {}
for i = 12, #ARGV - 3, 4 do
  local r = commit_call({ARGV[1], ARGV[2], ARGV[3], ARGV[i], ARGV[i + 1], ARGV[i + 2], '0', ARGV[i + 3], '0',
    ARGV[11]})
  if r.err then done[#done + 1] = r.err elseif r[4] == 1 then done[#done + 1] = 'MORE' else done[#done + 1] = 'OK' end
end
local got = take(ARGV)
if got.err then return {done, got.err} end
return {done, got}
