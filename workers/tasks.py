"""Tasks: thin wrappers that call services in yuxi/.

`execute_run` executes one run; `resume_wait` and `expire_wait` resume
suspended turns; `recover_runs` is the periodic sweep that recovers runs whose
lease expired, retries jobs of dead workers and re-delivers jobs and waits
lost between commit and pickup.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid

from procrastinate import JobContext

from workers.app import app, settings
from yuxi import db
from yuxi.heap import freeze_startup_heap
from yuxi.runtime import cleanup
from yuxi.runtime.executor import RunExecutor
from yuxi.services import runs, sandbox

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


async def close_executor() -> None:
    """Close this process's pools (the worker is stopping)."""
    async with _context_lock:
        executor = _context.pop("executor", None)
    if executor is not None:
        await executor.pool.close()
        await executor.checkpoint_pool.close()


@app.task(name="execute_run", queue="runs")
async def execute_run(run_id: str) -> str:
    executor = await _executor()
    outcome = await executor.execute(uuid.UUID(run_id))
    log.info("run %s: %s", run_id, outcome)
    return outcome


@app.task(name="resume_wait", queue="maintenance")
async def resume_wait(wait_id: str) -> str | None:
    """Create the resume run of a wait resolved from another tree."""
    run_id = await runs.resume_wait((await _executor()).pool, uuid.UUID(wait_id))
    return str(run_id) if run_id else None


@app.task(name="expire_wait", queue="maintenance")
async def expire_wait(wait_id: str) -> bool:
    """A wait's deadline: resume it with the timeout result if still pending."""
    return await runs.expire_wait((await _executor()).pool, uuid.UUID(wait_id))


@app.task(name="cleanup_turn", queue="maintenance")
async def cleanup_turn(turn_id: str) -> bool:
    """Clean a cancelling turn's checkpoint, then end it cancelled."""
    executor = await _executor()
    return await cleanup.clean_cancelled_turn(executor.pool, executor.checkpoint_pool,
                                              uuid.UUID(turn_id))


@app.periodic(cron="* * * * * */30")
@app.task(name="release_idle_sandboxes", queue="maintenance", pass_context=True,
          queueing_lock="release_idle_sandboxes")
async def release_idle_sandboxes(context: JobContext, timestamp: int) -> int:
    """Release tree sandboxes idle for 5 minutes (their workdirs stay)."""
    executor = await _executor()
    return len(await sandbox.release_idle(executor.pool, settings.data_dir))


@app.periodic(cron="* * * * * */2")
@app.task(name="recover_runs", queue="maintenance", pass_context=True,
          queueing_lock="recover_runs")
async def recover_runs(context: JobContext, timestamp: int) -> dict[str, int]:
    executor = await _executor()
    recovered = await runs.recover_expired(executor.pool, settings.max_run_attempts,
                                           settings.max_infra_retries)
    stalled = await app.job_manager.get_stalled_jobs(
        queue="runs", seconds_since_heartbeat=10.0)
    for job in stalled:
        # execute_run is idempotent: a retried job whose run moved on is a no-op.
        await app.job_manager.retry_job(job)
    redelivered = await runs.redeliver_ready(executor.pool, dt.timedelta(seconds=30))
    waits = await runs.redeliver_waits(executor.pool, dt.timedelta(seconds=5))
    cleanups = await runs.redeliver_cleanups(executor.pool, dt.timedelta(seconds=10))
    return {"recovered": len(recovered), "stalled": len(list(stalled)),
            "redelivered": len(redelivered), "waits": waits, "cleanups": cleanups}


# Everything the tasks run is imported now: keep the startup heap out of the
# garbage collector's walks (yuxi.heap).
freeze_startup_heap()
