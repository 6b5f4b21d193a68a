"""A worker process claims ready runs from the moment it starts (its LISTEN
connection, named `yuxi-claims <host>`, is in yuxi.claimers_v1), not from its
first job: a worker whose peers claimed every run would otherwise never get
a job, never claim, and one process would run every run
(workers.app.WorkerApp)."""

from __future__ import annotations

import asyncio
import random
import sys
from decimal import Decimal

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


LISTENING = """SELECT application_name, query FROM pg_stat_activity
                WHERE datname = current_database() AND query ILIKE 'LISTEN%%'"""


async def test_a_worker_process_has_one_listen_connection_that_wakes_its_jobs(start_worker, pg):
    # One LISTEN connection per worker process: its claims connection also
    # hears Procrastinate's job notifications (workers.app.WorkerConnector).
    # PostgreSQL wakes every listening backend at each notifying commit.
    start_worker()

    def listening() -> list[tuple[bool, bool]]:
        return [(r["application_name"].startswith("yuxi-claims "),
                 "procrastinate_queue_v1#runs" in r["query"])
                for r in pg.conn.execute(LISTENING).fetchall()]

    await wait_for(lambda: asyncio.sleep(0, listening() == [(True, True)]), 20,
                   "the claims connection, listening to the jobs too")
    await asyncio.sleep(1)
    assert listening() == [(True, True)]
    # Procrastinate's worker hears a job due now at once (3-11 ms here), not
    # at its next poll (every 0.25 s; inserted at random phases, five jobs
    # all fetched within 80 ms by polling is a 0.3 % chance): a job of no
    # task fails and stays, with the times of its insert and of its fetch.
    async def fetched_after() -> Decimal:
        job = pg.scalar("SELECT yuxi.defer_job_v1('runs', 'no_such_task', '{}'::jsonb, now())")
        await wait_for(lambda: asyncio.sleep(0, pg.scalar(
            "SELECT status::text FROM procrastinate.procrastinate_jobs WHERE id = %s",
            (job,)) == "failed"), 10, "the job's failure")
        return pg.scalar(
            "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'started')"
            " - max(at) FILTER (WHERE type = 'deferred')) FROM procrastinate.procrastinate_events"
            " WHERE job_id = %s", (job,))

    # A first job, not measured: a worker just started may still be busy
    # with its start (stop 57's whole-suite run fetched the first of five
    # after 257 ms, the other four after 2-3 ms).
    await fetched_after()
    delays = []
    for _ in range(5):
        await asyncio.sleep(random.uniform(0, 0.25))
        delays.append(await fetched_after())
    assert max(delays) < 0.08, delays
