"""cfemu.cf.CF.structure: a structure's handle is made, and its name checked, once per name (a member asks for one
per CF call); a bad name is refused every time; the handles kept are bounded."""

from __future__ import annotations

import pytest
import redis

from cfemu import cf as cfmod
from cfemu.cf import CF


def test_a_structure_handle_is_made_once_per_name(redis_url: str) -> None:
    cf = CF(redis.Redis.from_url(redis_url))
    assert cf.structure("APP1") is cf.structure("APP1")
    assert cf.structure("APP2") is not cf.structure("APP1")
    assert cf.structure("APP2").name == "APP2"


@pytest.mark.parametrize("bad", ["", "Q1\n", "a b", "x" * 49, 7])
def test_a_bad_structure_name_is_refused_every_time(redis_url: str, bad: object) -> None:
    cf = CF(redis.Redis.from_url(redis_url))
    for _ in range(2):
        with pytest.raises(ValueError, match="bad structure name"):
            cf.structure(bad)  # type: ignore[arg-type]


def test_the_handles_kept_are_bounded(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfmod, "MAX_STRUCTURE_HANDLES", 3)
    cf = CF(redis.Redis.from_url(redis_url))
    for i in range(10):
        assert cf.structure(f"S{i}").name == f"S{i}"
    assert len(cf._structures) == 3
    assert cf.structure("S9") is not cf.structure("S9")  # past the bound: made each time, still right
