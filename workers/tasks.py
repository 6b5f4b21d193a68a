"""Tasks: thin wrappers that call services in yuxi/.

`execute_run` executes one run; `recover_runs` is the periodic sweep that
recovers runs whose lease expired, retries jobs of dead workers and
re-delivers jobs lost between commit and pickup.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid

from procrastinate import JobContext

from workers.app import app, settings
from yuxi import db
from yuxi.runtime.executor import RunExecutor
from yuxi.services import runs

log = logging.getLogger(__name__)

_context: dict[str, object] = {}
_context_lock = asyncio.Lock()


async def _executor() -> RunExecutor:
    """Pools of this worker process, opened on first use (in the worker's loop)."""
    async with _context_lock:
        if "executor" not in _context:
            pool = db.app_pool(settings.database_url, max_size=settings.worker_concurrency + 2)
            checkpoints = db.checkpoint_pool(
                settings.database_url, max_size=settings.worker_concurrency + 2)
            await pool.open(wait=True)
            await checkpoints.open(wait=True)
            _context["executor"] = RunExecutor(settings, pool, checkpoints)
    return _context["executor"]  # type: ignore[return-value]


@app.task(name="execute_run", queue="runs")
async def execute_run(run_id: str) -> str:
    executor = await _executor()
    outcome = await executor.execute(uuid.UUID(run_id))
    log.info("run %s: %s", run_id, outcome)
    return outcome


@app.periodic(cron="* * * * * */2")
@app.task(name="recover_runs", queue="maintenance", pass_context=True,
          queueing_lock="recover_runs")
async def recover_runs(context: JobContext, timestamp: int) -> dict[str, int]:
    executor = await _executor()
    recovered = await runs.recover_expired(executor.pool, settings.max_run_attempts)
    stalled = await app.job_manager.get_stalled_jobs(
        queue="runs", seconds_since_heartbeat=10.0)
    for job in stalled:
        # execute_run is idempotent: a retried job whose run moved on is a no-op.
        await app.job_manager.retry_job(job)
    redelivered = await runs.redeliver_ready(executor.pool, dt.timedelta(seconds=30))
    return {"recovered": len(recovered), "stalled": len(list(stalled)),
            "redelivered": len(redelivered)}
