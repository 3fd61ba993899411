"""The chaos test suite: real faults against a running queue-sharing group, checked against a recorded history.

See docs/chaos.md. Modules: proxy (fault-injecting TCP proxy), history (JSONL history, and the ``Op`` every
checker reads), workload (client threads and the coordinator), recorded (one recorded call of a conversation or
publish/subscribe action), group (the cluster under test), faults/ (the fault kinds, one row each, and the seeded
schedule), the checkers as siblings over the history (checker: queues and restores, composing uowcheck and
pubsubcheck, which import no other checker), report, runner (one run, a soak), cli (``cfemu chaos``).
"""
