"""What only the test harness may do to the session CF: lose everything in it (FLUSHALL), as a CF loss does.

The session CF is secured like a group's (tests/conftest.py, GroupCF): the tests connect as a member, who may not
FLUSHALL; the harness user may. conftest registers its credentials here by address.
"""

from __future__ import annotations

import redis

HARNESS: dict[str, tuple[str, str]] = {}  # "host:port" -> (user, password) of the harness user


def lose_cf(client: redis.Redis) -> None:
    """Everything in the client's CF is lost (the harness user's FLUSHALL where the CF is secured)."""
    kw = client.connection_pool.connection_kwargs
    creds = HARNESS.get(f"{kw.get('host')}:{kw.get('port')}")
    if creds is None:
        client.flushall()
        return
    harness = redis.Redis(host=kw["host"], port=kw["port"], username=creds[0], password=creds[1])
    try:
        harness.flushall()
    finally:
        harness.close()
