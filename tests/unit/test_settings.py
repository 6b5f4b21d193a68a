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


def test_host_id_defaults_to_the_hostname_and_must_name_a_queue():
    import socket

    assert Settings.from_env({}).host_id == socket.gethostname()
    assert Settings.from_env({"YUXI_HOST_ID": "worker-2.eu"}).host_id == "worker-2.eu"
    for bad in ("a b", "-x", "a@b", "x" * 101):
        with pytest.raises(SystemExit, match="YUXI_HOST_ID"):
            Settings.from_env({"YUXI_HOST_ID": bad})


def test_worker_metrics_port_and_direct_database_url():
    assert Settings.from_env({}).worker_metrics_port == 0
    assert Settings.from_env({"YUXI_WORKER_METRICS_PORT": "9100"}).worker_metrics_port == 9100
    with pytest.raises(SystemExit, match="YUXI_WORKER_METRICS_PORT"):
        Settings.from_env({"YUXI_WORKER_METRICS_PORT": "70000"})
    assert Settings.from_env({"YUXI_HOST_TIMEOUT_SECONDS": "3"}).host_timeout_seconds == 3
    with pytest.raises(SystemExit, match="YUXI_HOST_TIMEOUT_SECONDS"):
        Settings.from_env({"YUXI_HOST_TIMEOUT_SECONDS": "0"})
    plain = Settings.from_env({"YUXI_DATABASE_URL": "postgresql://db/yuxi"})
    assert plain.session_database_url == "postgresql://db/yuxi" and not plain.pooled
    pooled = Settings.from_env({"YUXI_DATABASE_URL": "postgresql://bouncer:6432/yuxi",
                                "YUXI_DIRECT_DATABASE_URL": "postgresql://db/yuxi"})
    assert pooled.session_database_url == "postgresql://db/yuxi" and pooled.pooled
