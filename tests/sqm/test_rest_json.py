"""The REST door's JSON is strict JSON: never NaN or Infinity, which JSON has no numbers for (JavaScript's
JSON.parse refuses a body holding one whole). A float property that is not finite (the puts refuse one, but a message
stored before that rule, or put by another path, may hold one) is given as a string: "NaN", "Infinity",
"-Infinity", in a messagelist's userProperties and in a browsed message's ibm-mq-usr-* header. A real member
serving REST in this process, a real redis-server, a plain HTTP client."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

from cfemu.entry import Entry
from sqm.service.rest import finite, to_json
from tests.sqm.test_rest import basic, http
from tests.support.inprocess_server import RunningServer
from tests.support.rest_member import TOKEN, rest_member_of_its_own, rest_url

ODD = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "fine": 1.5, "text": "NaN?"}
SHOWN = {"nan": "NaN", "inf": "Infinity", "ninf": "-Infinity", "fine": 1.5, "text": "NaN?"}


@pytest.fixture(scope="module")
def member(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with rest_member_of_its_own(redis_server, tmp_path_factory.mktemp("json")) as running:
        yield running


def strict(text: bytes) -> Any:
    """JSON as a strict parser reads it: NaN, Infinity and -Infinity are refused."""
    def refuse(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_property_that_is_not_a_finite_number_is_given_as_a_string(member: RunningServer) -> None:
    qm = member.server.qm
    # Written to the CF as an older store could hold it: the put's own check refuses such properties.
    qm.structure("APP1").put(qm.caller, Entry(id="odd1", queue="Q1", msgid="0a" * 24, properties=dict(ODD)), b"x")
    r = http("GET", rest_url(member, resource="messagelist"), headers=basic(TOKEN), auth=False)
    assert r.status == 200, (r.status, r.body[:300])
    [listed] = strict(r.body)["messages"]
    assert listed["userProperties"] == SHOWN
    r = http("GET", rest_url(member), headers=basic(TOKEN), auth=False)
    assert r.status == 200 and r.body == b"x", (r.status, r.body[:300])
    assert {k: r.headers[f"ibm-mq-usr-{k}"] for k in ODD} == {k: str(v) for k, v in SHOWN.items()}


def test_every_json_the_door_writes_is_strict() -> None:
    assert strict(to_json({"a": [math.nan, {"b": math.inf}], "c": (-math.inf, 2.0)}).encode()) == {
        "a": ["NaN", {"b": "Infinity"}], "c": ["-Infinity", 2.0]}
    assert finite(1.0) == 1.0 and finite("x") == "x"
