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

from benchmarks.run import _die_with_parent
from yuxi.cli import api_command, worker_command

E2E_DIR = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/e2e carries the `e2e` marker (`pytestmark` in a
    conftest has no effect: each module sets it), or the run stops here, so
    `-m "not e2e"` can never start real processes unawares."""
    unmarked = [item.nodeid for item in items
                if E2E_DIR in item.path.parents and item.get_closest_marker("e2e") is None]
    if unmarked:
        raise pytest.UsageError("tests under tests/e2e without the e2e marker "
                                "(add `pytestmark = pytest.mark.e2e`): " + ", ".join(unmarked))


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
        # Dies with the test run: a run stopped by a signal skips the
        # fixtures' teardown, and services left running hold connections to
        # the test databases (the next run's CREATE DATABASE waits on them).
        self.popen = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=_die_with_parent if sys.platform == "linux"
                                      else None)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def _procs(db_url: str) -> Iterator[list[Proc]]:
    """Every process a test started; at the end all are asked to stop at
    once (graceful shutdowns overlap), then awaited. It depends on `db_url`
    so its teardown runs before the test database is dropped."""
    procs: list[Proc] = []
    yield procs
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.stop()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Workdirs and sandboxes of this test's processes."""
    return tmp_path / "data"


@pytest.fixture
def proc_env(db_url: str, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(
        YUXI_DATABASE_URL=db_url,
        YUXI_DATA_DIR=str(data_dir),
        YUXI_LEASE_SECONDS="2",
        YUXI_SSE_KEEPALIVE_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


class ApiStarter:
    """`start_api()` -> base URL of a new API process on this test's database;
    `start_api.many(n)` starts n of them side by side (they boot in parallel);
    `start_api.procs` are the API processes started so far (Proc)."""

    def __init__(self, all_procs: list[Proc], env: dict[str, str], log_dir: Path) -> None:
        self.all_procs, self.env, self.log_dir = all_procs, env, log_dir
        self.procs: list[Proc] = []

    def _spawn(self, extra_env: dict[str, str]) -> tuple[Proc, str]:
        port = free_port()
        # The product's own command line (what `yuxi dev` runs).
        proc = Proc(f"api-{len(self.procs)}", api_command("127.0.0.1", port),
                    {**self.env, **extra_env}, self.log_dir)
        self.procs.append(proc)
        self.all_procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    @staticmethod
    def _wait_healthy(proc: Proc, base: str) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"API exited:\n{proc.log()}")
            try:
                if httpx.get(f"{base}/api/healthz", timeout=1).status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"API did not start:\n{proc.log()}")

    def __call__(self, **extra_env: str) -> str:
        return self._wait_healthy(*self._spawn(extra_env))

    def many(self, n: int, **extra_env: str) -> list[str]:
        spawned = [self._spawn(extra_env) for _ in range(n)]
        return [self._wait_healthy(proc, base) for proc, base in spawned]


@pytest.fixture
def start_api(_procs, proc_env, tmp_path) -> ApiStarter:
    """start_api() -> base URL of a new API process on this test's database."""
    return ApiStarter(_procs, proc_env, tmp_path)


@pytest.fixture
def start_worker(_procs, proc_env, tmp_path):
    """start_worker() -> a new `procrastinate worker` process (Proc)."""
    count = 0

    def start(**extra_env: str) -> Proc:
        nonlocal count
        proc = Proc(f"worker-{count}", worker_command([]), {**proc_env, **extra_env}, tmp_path)
        count += 1
        _procs.append(proc)
        return proc

    return start


@pytest.fixture
def worker(start_worker):
    return start_worker()


@pytest.fixture
def api(start_api) -> str:
    return start_api()


@pytest.fixture
def pg(db_url: str) -> Iterator:
    """Direct autocommit reads of this test's database (tests/e2e/helpers.Db)."""
    from tests.e2e.helpers import Db

    conn = Db(db_url)
    yield conn
    conn.close()
