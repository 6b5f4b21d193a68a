"""A worker process claims ready runs from the moment it starts (its LISTEN
connection, named `yuxi-claims <host>`, is in yuxi.claimers_v1), not from its
first job: a worker whose peers claimed every run would otherwise never get
a job, never claim, and one process would run every run
(workers.app.WorkerApp)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.e2e.conftest import Proc
from tests.e2e.helpers import wait_for

pytestmark = pytest.mark.e2e

# `procrastinate worker` serving the `runs` queue only: no periodic job of
# the host queue (its heartbeat) or maintenance job reaches it, and no run is
# submitted, so it never gets a job.
CLI = ["-m", "procrastinate", "--app=workers.app.app", "worker", "--queues", "runs"]
# The same worker as before this change: its executor (and its claims)
# opened at its first job only.
LAZY = ["-c", "import procrastinate, workers.app as a; "
              "a.WorkerApp.run_worker_async = procrastinate.App.run_worker_async; "
              "from procrastinate.cli import main; main()",
        "--app=workers.app.app", "worker", "--queues", "runs"]


def _claimers(pg) -> int:
    return pg.scalar("SELECT count(*) FROM yuxi.claimers_v1()")


async def test_a_worker_claims_from_its_start(_procs, proc_env, tmp_path, pg, start_worker):
    start_worker()  # `python -m workers.run`
    await wait_for(lambda: asyncio.sleep(0, _claimers(pg) == 1), 20, "the first claimer")
    # Procrastinate's own command, with no job for it.
    _procs.append(Proc("cli-worker", [sys.executable, *CLI], proc_env, tmp_path))
    await wait_for(lambda: asyncio.sleep(0, _claimers(pg) == 2), 20, "the second claimer")
    assert pg.scalar("SELECT count(*) FROM procrastinate.procrastinate_jobs "
                     "WHERE queue_name = 'runs'") == 0


async def test_a_worker_opened_at_its_first_job_never_claims_without_one(
        _procs, proc_env, tmp_path, pg):
    # Negative case: the executor opened lazily, the worker with no job is
    # never a claimer (a peer that claims every run starves it for good).
    proc = Proc("lazy-worker", [sys.executable, *LAZY], proc_env, tmp_path)
    _procs.append(proc)
    await wait_for(lambda: asyncio.sleep(0, pg.scalar(
        "SELECT count(*) FROM procrastinate.procrastinate_workers")), 20, "the worker's start")
    await asyncio.sleep(3)
    assert proc.popen.poll() is None, proc.log()
    assert _claimers(pg) == 0
