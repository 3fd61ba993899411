"""ServerConfig.check refuses a duration that is not a finite number of seconds >= 0, in one line naming it: code
that builds a config itself (an embedding program, the supervisor) is not behind `sqm run`'s option parser, and a
NaN passes every comparison check makes, an infinity most of them."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest

from sqm.service.config import ServerConfig, ServerConfigError

DURATIONS = [f.name for f in fields(ServerConfig) if isinstance(f.default, float)]


def test_the_durations_are_the_float_options() -> None:
    assert {"auth_timeout_s", "idle_timeout_s", "checkpoint_interval_s", "shutdown_grace_s",
            "cf_wait_s"} <= set(DURATIONS)


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_duration_that_is_not_a_finite_number_of_seconds_is_refused(tmp_path: Path, name: str,
                                                                      value: float) -> None:
    config = ServerConfig(name="QM1", log_root=tmp_path, token="t", **{name: value})
    with pytest.raises(ServerConfigError) as e:
        config.check()
    assert name in str(e.value) and "\n" not in str(e.value)


def test_the_defaults_pass(tmp_path: Path) -> None:
    ServerConfig(name="QM1", log_root=tmp_path, token="t").check()
