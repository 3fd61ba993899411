-- standing: how a UOW stands on this structure, read only. A member about to force a UOW's COMMIT asks each of its
-- structures whether a persistent store is disconnected ('D' below). A member that forced the decision of a UOW
-- spanning several structures asks each of them before it applies the outcome on any
-- (sqm.core.manager.QueueManager.apply): a structure that refuses must refuse first, so that a UOW never ends committed on one structure and backed out
-- on another (UOW atomicity across structures). Also refused, as by commit.lua: a structure that is not ACTIVE
-- (CFSTATE: the outcome waits for it, applied nowhere yet) and a fenced member (FENCED).
-- Idempotent (reads only).
-- ARGV: 1 member, 2 epoch, 3 uow, 4 uow gen (the generation the UOW started in on this structure; 0: unknown)
-- Returns one letter: 'H' the structure holds the UOW (its record is here), 'C' / 'B' an outcome decided by
-- recovery or carried over by restore (tombstone), 'L' the UOW is unknown here and from an older generation (lost
-- with the CF: its work here cannot be committed), 'N' unknown here in its own generation (nothing left to do),
-- 'D' the structure holds the UOW and its persistent store is disconnected: a member asks before it forces a
-- UOW's COMMIT, and backs the UOW out instead (docs/pstore.md); a commit decided already goes on (commit.lua).
local err = check_ready(ARGV[1], ARGV[2]) if err then return err end
local uow = ARGV[3]
local t = tomb(uow)
if t then return t end
if uow_raw(uow) then return disconnected() and 'D' or 'H' end
if carried_over(ARGV[4]) then return 'L' end
return 'N'
