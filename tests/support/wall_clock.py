"""A wall clock stepped back (NTP, or a backup or purge run on a host whose clock is behind), for the module that
names its backups or restore points by the time (backup.run, backup.points): the ids it makes while the step lasts
say they are older than those made before it, while the CF's LRSNs still go on rising."""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any


@contextlib.contextmanager
def clock_behind(module: Any, by: timedelta = timedelta(minutes=2)) -> Iterator[None]:
    """The wall clock ``module`` names its ids by (its ``datetime``) is ``by`` behind, in the block."""
    real = datetime

    class Behind(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return real.now(tz) - by

    with unittest.mock.patch.object(module, "datetime", Behind):
        yield
