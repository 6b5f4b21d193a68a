"""Real processes: the API (uvicorn) and `procrastinate worker` as
subprocesses on this test's fresh database, driven over HTTP and SSE."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its log in a file (read it when a test fails)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def proc_env(db_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(
        YUXI_DATABASE_URL=db_url,
        YUXI_LEASE_SECONDS="2",
        YUXI_SSE_KEEPALIVE_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def start_api(proc_env, tmp_path) -> Iterator:
    """start_api() -> base URL of a new API process on this test's database."""
    procs: list[Proc] = []

    def start(**extra_env: str) -> str:
        port = free_port()
        env = {**proc_env, **extra_env}
        proc = Proc(f"api-{len(procs)}", [str(BIN / "python"), "-m", "uvicorn", "--factory",
                                          "yuxi.api.app:create_app", "--host", "127.0.0.1",
                                          "--port", str(port)], env, tmp_path)
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"API exited:\n{proc.log()}")
            try:
                if httpx.get(f"{base}/api/healthz", timeout=1).status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"API did not start:\n{proc.log()}")

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def start_worker(proc_env, tmp_path) -> Iterator:
    """start_worker() -> a new `procrastinate worker` process (Proc)."""
    procs: list[Proc] = []

    def start(**extra_env: str) -> Proc:
        proc = Proc(f"worker-{len(procs)}",
                    [str(BIN / "procrastinate"), "--app=workers.app.app", "worker"],
                    {**proc_env, **extra_env}, tmp_path)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def api(start_api) -> str:
    return start_api()


@pytest.fixture
def worker(start_worker):
    return start_worker()


@pytest.fixture
def pg(db_url: str) -> Iterator:
    """Direct autocommit reads of this test's database (tests/e2e/helpers.Db)."""
    from tests.e2e.helpers import Db

    conn = Db(db_url)
    yield conn
    conn.close()
