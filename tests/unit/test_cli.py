"""The real `yuxi` command in a subprocess: operator mistakes are one line on
stderr and exit 1, bad arguments exit 2. No database is created here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

YUXI = Path(sys.executable).parent / "yuxi"


def run_yuxi(*args: str, database_url: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    if database_url is not None:
        env["YUXI_DATABASE_URL"] = database_url
    return subprocess.run([str(YUXI), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("yuxi: error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_unreachable_server_is_one_line_naming_host_and_port():
    # Nothing listens on port 1.
    result = run_yuxi("db", "init", database_url="postgresql://postgres@127.0.0.1:1/yuxi")
    assert_one_line_error(result)
    assert "127.0.0.1:1" in result.stderr


@pytest.mark.parametrize("url", ["notaurl://x", "postgresql://postgres@127.0.0.1/yuxi?foo=bar"])
def test_malformed_url_is_one_line(url):
    assert_one_line_error(run_yuxi("db", "init", database_url=url))


def test_keys_create_on_unreachable_server_is_one_line():
    result = run_yuxi("keys", "create", "--user", "u", "--app", "a",
                      database_url="postgresql://postgres@127.0.0.1:1/yuxi")
    assert_one_line_error(result)


def test_missing_argument_exits_2():
    result = run_yuxi("keys", "create", "--user", "u")
    assert result.returncode == 2
    assert "--app" in result.stderr


def test_invalid_agent_config_exits_2():
    result = run_yuxi("agents", "create", "--user", "u", "--app", "a", "--name", "n",
                      "--config", "{not json")
    assert result.returncode == 2
    assert "--config" in result.stderr


def test_unknown_argument_exits_2():
    assert run_yuxi("db", "init", "--bogus").returncode == 2


def test_help_exits_0():
    result = run_yuxi("--help")
    assert result.returncode == 0
    for command in ("db", "keys", "agents", "serve", "worker", "dev"):
        assert command in result.stdout
