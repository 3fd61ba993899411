"""An exhaustive model checker for the fuzzy backup protocol (docs/invariants.md, invariant 4).

scheduler: a stateless depth-first search over every interleaving of a few actors (generators that yield between
           atomic steps), replaying each schedule from a fresh world.
actors:    the world (a flushed real CF with the real Lua scripts, in-memory member logs written with the record
           shapes of sqm/core/manager.py), the members' operations, the backup actor (backup.protocol), and the checks
           that lose the CF and fold the backup plus logs with the real restore.plan.plan_local.
"""
