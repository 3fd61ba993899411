"""The chaos test suite: real faults against a running queue-sharing group, checked against a recorded history.

See docs/chaos.md. Modules: proxy (fault-injecting TCP proxy), history (JSONL history), workload (client
threads and the coordinator), group (the cluster under test), faults (fault kinds and the seeded schedule),
checker, report, runner (one run, a soak), cli (``cfemu chaos``).
"""
