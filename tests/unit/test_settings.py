"""Settings from the environment."""

from __future__ import annotations

import pytest

from yuxi.settings import Settings


def test_the_sandbox_sweep_period_is_a_setting_within_bounds():
    assert Settings.from_env({}).sandbox_sweep_seconds == 30
    assert Settings.from_env({"YUXI_SANDBOX_SWEEP_SECONDS": "1"}).sandbox_sweep_seconds == 1
    for bad in ("0", "31", "x"):
        with pytest.raises(SystemExit, match="invalid setting"):
            Settings.from_env({"YUXI_SANDBOX_SWEEP_SECONDS": bad})
