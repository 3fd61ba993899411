"""The watch on the application behind a connection handle: set when it has left (the service's client
disconnected), so that a waiting get stops waiting and a get outside syncpoint takes nothing for nobody.

Two questions, two costs. ``is_set()`` may look at the connection itself: the service's watch of a connection
served by its own thread reads its socket (a select and a peek: system calls, each a hand-off of the GIL).
``seen_to_leave()`` answers from the flag alone, whatever a subclass's is_set does: what a request asks when a
look at the socket would cost more than it can learn (before its first wait, after it ran).
"""

from __future__ import annotations

import threading


class ClientWatch(threading.Event):
    """Set when the application behind a connection has left (``set()``: it was seen to leave)."""

    # The base class's is_set itself, not a method calling it: the flag at the cost of one attribute read.
    seen_to_leave = threading.Event.is_set
