"""Two `cfrestore run APP1` started together after a CF loss: the one that claims second saw the structure missing,
and finds it RECOVERING in generation 1 under the other's claim. Its refusal said "a purge emptied the structure
since this one started" - no purge ran, and an operator on call goes looking for who purged. The words must say
what is known: another restore or a purge holds the structure and has not finished."""

from __future__ import annotations

import redis

from cfemu import bulk
from cfemu.admin import StructureDef

S = "APP1"


def test_a_claim_of_a_lost_structure_that_another_restore_holds_names_it_in_progress(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    seen = bulk.observe(client, S)  # the CF was lost: no structure
    assert seen.state == "" and seen.gen == 0
    with bulk.claim(client, S, bulk.observe(client, S)) as other:  # the other restore, in its load
        bulk.reset(other, StructureDef(S))  # as the other's load begins: the structure RECOVERING, generation 1
        why = bulk.changed_since(seen, bulk.observe(client, S))
        assert why is not None
        assert "purge emptied" not in str(why), why
        assert str(why).startswith("another restore or a purge took the structure over since this one started and "
                                   "has not finished (now RECOVERING, generation 1"), why
