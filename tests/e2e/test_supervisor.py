"""No silent exits (issue 12): `yuxi worker` and `yuxi dev` restart a crashed
child with backoff and say so on the console; a worker process that must
exit on a fatal error exits non-zero."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.e2e.conftest import Proc, free_port

pytestmark = pytest.mark.e2e


def _wait(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := probe()):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _children(proc: Proc) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.popen.pid).children()
    except psutil.NoSuchProcess:
        return []


def _child_running(proc: Proc, module: str, not_pid: int | None = None):
    for child in _children(proc):
        try:
            if module in " ".join(child.cmdline()) and child.pid != not_pid:
                return child
        except psutil.NoSuchProcess:
            pass
    return None


def test_yuxi_worker_restarts_a_killed_worker_and_says_so(proc_env, _procs, tmp_path, pg):
    proc = Proc("yuxi-worker", [sys.executable, "-m", "yuxi.cli", "worker"], proc_env, tmp_path)
    _procs.append(proc)
    worker = _wait(lambda: _child_running(proc, "workers.run"), 30, "the worker child")
    _wait(lambda: pg.scalar("SELECT count(*) FROM procrastinate.procrastinate_workers"), 30,
          "the worker to register")
    worker.send_signal(signal.SIGKILL)
    replacement = _wait(lambda: _child_running(proc, "workers.run", not_pid=worker.pid), 30,
                        "a new worker child")
    assert replacement.pid != worker.pid
    assert "the worker process was killed by signal 9; restarting it in 1 s" in proc.log()
    assert "starting the worker process again" in proc.log()
    assert proc.popen.poll() is None
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0
    assert not replacement.is_running() or replacement.status() == psutil.STATUS_ZOMBIE


def test_yuxi_dev_restarts_a_killed_api(proc_env, _procs, tmp_path):
    port = free_port()
    env = {**proc_env, "YUXI_PORT": str(port)}
    proc = Proc("yuxi-dev", [sys.executable, "-m", "yuxi.cli", "dev"], env, tmp_path)
    _procs.append(proc)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(healthy, 60, "the API of yuxi dev")
    api = _wait(lambda: _child_running(proc, "uvicorn"), 10, "the API child")
    api.send_signal(signal.SIGKILL)
    _wait(lambda: "the API process was killed by signal 9; restarting it in 1 s" in proc.log(),
          10, "the restart notice")
    _wait(lambda: _child_running(proc, "uvicorn", not_pid=api.pid), 20, "a new API child")
    _wait(healthy, 60, "the restarted API")
    assert proc.popen.poll() is None
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0


def test_a_worker_with_a_fatal_error_exits_non_zero(proc_env, tmp_path):
    env = {**proc_env, "YUXI_WORKER_CONCURRENCY": "not-a-number"}
    result = subprocess.run([sys.executable, "-m", "workers.run"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "invalid setting" in result.stderr
