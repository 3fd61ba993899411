"""The doors' connection cap: past the per-address cap a newcomer is refused; past the total cap a connection that
waits for its first request head is evicted for it, else an idle one, of those one of the address holding the most
connections, then the oldest; the newcomer is refused only when every connection has a request under way."""

from __future__ import annotations

from dataclasses import dataclass

from cfemu.connection_cap import ConnectionCap, Waiting


@dataclass(eq=False)
class _Conn:
    state: Waiting
    evicted: bool = False

    def waiting(self) -> Waiting:
        return self.state

    def evict(self) -> None:
        self.evicted = True


def test_the_oldest_waiting_connection_makes_room_and_the_per_address_cap_still_refuses() -> None:
    cap = ConnectionCap(total=3, per_peer=2)
    busy, idle, head = _Conn(None), _Conn("idle"), _Conn("head")
    assert cap.admit("a", busy) is None and cap.admit("a", idle) is None and cap.admit("b", head) is None
    assert cap.admit("a", _Conn("head")) == "2 connections at once from a"  # per address: refused, nobody evicted
    assert not (busy.evicted or idle.evicted or head.evicted)
    newer = _Conn("head")
    assert cap.admit("c", newer) is None
    assert head.evicted and not idle.evicted  # one without a whole head goes before an idle one, however young
    cap.release("b", head)  # its close, after the eviction: counted once
    assert (cap.open, cap.evicted) == (3, 1)
    newer.state = None
    assert cap.admit("d", _Conn("head")) is None and idle.evicted  # then the oldest idle one
    idle.state = None
    assert cap.admit("e", _Conn("head")) is None  # the one "d" opened waits for its head: it goes
    held = [_Conn(None) for _ in range(3)]
    cap = ConnectionCap(total=3, per_peer=3)
    for c in held:
        assert cap.admit("a", c) is None
    assert cap.admit("b", _Conn("head")) == "3 connections at once (each with a request under way)"
    assert cap.refused == 1 and not any(c.evicted for c in held)
    for c in held:
        cap.release("a", c)
    assert cap.open == 0


def test_the_address_holding_the_most_connections_gives_way_first() -> None:
    """An evicted connection reopened at once evicts another: by age alone that round reached a newcomer of another
    address before its head came; the address holding the most connections gives way first."""
    cap = ConnectionCap(total=4, per_peer=2)
    crowd = [(_Conn("head"), peer) for peer in ("c1", "c2") for _ in range(2)]
    for c, peer in crowd:
        assert cap.admit(peer, c) is None
    lone = _Conn("head")
    assert cap.admit("lone", lone) is None
    for _ in range(10):  # each evicted one reopened at once, from its address
        [(evicted, peer)] = [(c, p) for c, p in crowd if c.evicted]
        crowd.remove((evicted, peer))
        crowd.append((_Conn("head"), peer))
        assert cap.admit(peer, crowd[-1][0]) is None
        assert not lone.evicted
    assert cap.evicted == 11
