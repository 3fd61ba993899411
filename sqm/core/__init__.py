"""The queue manager's kernel: its life cycle, the record log's use (append and force, checkpoints, log space),
CF calls and membership, the outcomes of units of work, restart and peer recovery, RECAUTO, the application's
handle (MQCONN). It imports nothing of sqm but sqm.log; features plug in through sqm.core.hooks and use the
queue manager through sqm.core.member (docs/architecture.md, "Inside sqm")."""
