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


def test_a_pipelines_small_commands_go_to_the_socket_as_one_write(redis_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from cfemu.admin import Admin  # noqa: PLC0415
    from cfemu.connection import connect  # noqa: PLC0415

    client = connect(redis_url, max_connections=1)
    try:
        Admin(client).define_structure("APP1")
        Admin(client).define_queue("Q1", "APP1")
        cf = CF(client)
        sent: list[int] = []
        real = cfmod.exchange

        def counted(conn: object, chunks: list[bytes], replies: int) -> list[object]:
            sent.append(len(chunks))
            return real(conn, chunks, replies)

        monkeypatch.setattr(cfmod, "exchange", counted)
        browse = ("browse", "APP1", ["Q1", 10, 0, 0, 0])
        assert cf.run_many([browse] * 3) == [[0, b""]] * 3  # each: nothing more, the queue's end, no message
        monkeypatch.setattr(cfmod, "JOINED_SEND", 10)  # commands longer than that in all: written one by one
        assert cf.run_many([browse] * 3) == [[0, b""]] * 3  # each: nothing more, the queue's end, no message
        assert sent == [1, 3]
    finally:
        client.close()
