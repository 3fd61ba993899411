"""sqm.operations.arg: a request's arguments type-checked, the common case (exactly the type asked for) taken at once,
every other case as before: a bool is never an int, a missing argument takes its default or is refused, a wrong
type is refused naming the operation and the argument."""

from __future__ import annotations

import pytest

from cfemu.errors import BadRequestError
from sqm.operations import arg


def test_the_type_asked_for_is_taken() -> None:
    assert arg({"n": 3}, "op", "n", int) == 3
    assert arg({"b": b"x"}, "op", "b", bytes) == b"x"
    assert arg({"f": True}, "op", "f", bool) is True
    assert arg({"q": "Q1"}, "op", "q", (str, bytes)) == "Q1"


def test_a_missing_argument_takes_its_default_or_is_refused() -> None:
    assert arg({}, "op", "c", bytes, b"") == b""
    assert arg({}, "op", "m", bytes, None) is None
    assert arg({"m": None}, "op", "m", bytes, None) is None
    with pytest.raises(BadRequestError, match="op: missing argument 'q'"):
        arg({}, "op", "q", str)


@pytest.mark.parametrize(("value", "kind", "words"), [
    (True, int, "argument 'x' must be int, not bool"),
    (1, bool, "argument 'x' must be bool, not int"),
    ("1", int, "argument 'x' must be int, not str"),
    (None, int, "argument 'x' must be int, not NoneType"),
    (b"x", (str, int), "argument 'x' must be str or int, not bytes"),
])
def test_a_wrong_type_is_refused_by_name(value: object, kind: type | tuple[type, ...], words: str) -> None:
    with pytest.raises(BadRequestError, match=words):
        arg({"x": value}, "put", "x", kind)


def test_a_subclass_of_the_type_is_still_taken() -> None:
    class Name(str):
        pass

    assert arg({"q": Name("Q1")}, "op", "q", str) == "Q1"
