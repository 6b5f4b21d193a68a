"""Tasks: thin wrappers that call services in yuxi/.

`execute_run` executes one run; `resume_wait` and `expire_wait` resume
suspended turns; `recover_runs` is the periodic sweep that recovers runs whose
lease expired, retries jobs of dead workers and re-delivers jobs and waits
lost between commit and pickup (and drops the event watches of backends
that are gone).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid

from procrastinate import JobContext

from workers.app import HOST_QUEUE, app, settings
from yuxi import db
from yuxi.heap import freeze_startup_heap
from yuxi.metrics import WorkerMetrics
from yuxi.runtime import cleanup, confine
from yuxi.runtime.executor import RunExecutor
from yuxi.services import retention, runs, sandbox

log = logging.getLogger(__name__)

_context: dict[str, object] = {}
_context_lock = asyncio.Lock()
_opened = asyncio.Event()  # the executor is open (relay_notifications)

# This process's own figures, on YUXI_WORKER_METRICS_PORT (docs/operator-guide.md).
metrics: WorkerMetrics | None = None
if settings.worker_metrics_port:
    metrics = WorkerMetrics()
    metrics.serve(settings.worker_metrics_port)


async def _executor() -> RunExecutor:
    """Pools of this worker process, opened as the worker starts
    (start_executor) or by its first job, whichever comes first (in the
    worker's loop)."""
    async with _context_lock:
        if "executor" not in _context:
            pool = db.app_pool(settings.database_url, max_size=settings.worker_concurrency + 2,
                               prepare=not settings.pooled)
            checkpoints = db.checkpoint_pool(
                settings.session_database_url, max_size=settings.worker_concurrency + 2)
            await pool.open(wait=True)
            await checkpoints.open(wait=True)
            _context["executor"] = executor = RunExecutor(settings, pool, checkpoints)
            executor.metrics = metrics
            # Ready runs of this worker's run queues are claimed as they are
            # deferred while the process has a free slot (their jobs are the
            # fallback): one round trip from ready to running.
            if settings.worker_claims:
                executor.claims(("runs", HOST_QUEUE))
            # The host heartbeat goes on in this process whatever its jobs do
            # (a worker busy with long runs still holds its sandboxes).
            _context["heartbeat"] = asyncio.create_task(_host_heartbeats(pool),
                                                        name="yuxi-host-heartbeat")
            _opened.set()
    return _context["executor"]  # type: ignore[return-value]


async def relay_notifications(channels, on_notification) -> None:
    """Procrastinate's job notifications (`channels`), heard on this
    process's one LISTEN connection, the executor's, once it is open; until
    cancelled (workers.app.WorkerConnector)."""
    while (executor := _context.get("executor")) is None:
        await _opened.wait()
    await executor.listener.relay(channels, on_notification)


def start_executor() -> None:
    """Open this process's executor in the background (the worker is
    starting): its claims begin now. A failure (the database away) is
    logged; the first job opens it then."""
    if "executor" in _context or "opening" in _context:
        return

    def opened(task: asyncio.Task) -> None:
        _context.pop("opening", None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("opening the executor: %s; the first job opens it",
                        task.exception())

    task = asyncio.create_task(_executor(), name="yuxi-open-executor")
    _context["opening"] = task
    task.add_done_callback(opened)


async def _host_heartbeats(pool) -> None:
    while True:
        try:
            await runs.host_heartbeat(pool, settings.host_id)
        except Exception:  # a transient database error: the next beat retries
            log.exception("host heartbeat failed")
        await asyncio.sleep(settings.host_timeout_seconds / 6)


# Every worker process of a host runs this (its own periodic id and queue):
# the first one starts the process's heartbeat loop.
@app.periodic(cron="* * * * * */2", periodic_id=settings.host_id, queue=HOST_QUEUE,
              queueing_lock=f"host_heartbeat@{settings.host_id}")
@app.task(name="host_heartbeat", queue=HOST_QUEUE, pass_context=True)
async def host_heartbeat(context: JobContext, timestamp: int) -> None:
    executor = await _executor()
    await runs.host_heartbeat(executor.pool, settings.host_id)


def stop_claims() -> None:
    """Claim no more ready runs (the worker is stopping)."""
    executor = _context.get("executor")
    if executor is not None:
        executor.stop_claims()


async def close_executor() -> None:
    """Close this process's pools (the worker is stopping)."""
    async with _context_lock:
        executor = _context.pop("executor", None)
        _opened.clear()
    if executor is not None:
        await executor.close_claims()
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


# Every YUXI_SANDBOX_SWEEP_SECONDS (30 by default) seconds of each minute, on
# each host (its sandboxes' files and processes are on its own disk).
@app.periodic(cron=f"* * * * * */{settings.sandbox_sweep_seconds}",
              periodic_id=settings.host_id, queue=HOST_QUEUE,
              queueing_lock=f"release_idle_sandboxes@{settings.host_id}")
@app.task(name="release_idle_sandboxes", queue=HOST_QUEUE, pass_context=True)
async def release_idle_sandboxes(context: JobContext, timestamp: int) -> int:
    """Release this host's tree sandboxes idle for 5 minutes (workdirs stay)."""
    executor = await _executor()
    return len(await sandbox.release_idle(executor.pool, settings.data_dir,
                                          host=settings.host_id))


@app.periodic(cron="* * * * * */2")
@app.task(name="recover_runs", queue="maintenance", pass_context=True,
          queueing_lock="recover_runs")
async def recover_runs(context: JobContext, timestamp: int) -> dict[str, int]:
    executor = await _executor()
    recovered = await runs.recover_expired(executor.pool, settings.max_run_attempts,
                                           settings.max_infra_retries)
    stalled = await app.job_manager.get_stalled_jobs(
        task_name="execute_run", seconds_since_heartbeat=10.0)
    for job in stalled:
        # execute_run is idempotent: a retried job whose run moved on is a no-op.
        await app.job_manager.retry_job(job)
    redelivered = await runs.redeliver_ready(executor.pool, dt.timedelta(seconds=30))
    waits = await runs.redeliver_waits(executor.pool, dt.timedelta(seconds=5))
    cleanups = await runs.redeliver_cleanups(executor.pool, dt.timedelta(seconds=10))
    # After the retries: a retried job of a dead host moves to the shared queue.
    hosts = await runs.release_dead_hosts(
        executor.pool, dt.timedelta(seconds=settings.host_timeout_seconds))
    watches = await retention.forget_gone_watches(executor.pool)
    if metrics is not None:
        metrics.recovered({"lease_expired": len(recovered), "stalled_job": len(list(stalled)),
                           "ready_redelivered": len(redelivered), "wait": waits,
                           "cancel_cleanup": cleanups, "dead_host_sandbox": hosts})
    return {"recovered": len(recovered), "stalled": len(list(stalled)), "dead_host_sandboxes": hosts,
            "redelivered": len(redelivered), "waits": waits, "cleanups": cleanups,
            "gone_watches": watches}


def _announce_sandbox() -> None:
    """Say at startup how this worker runs a tree's commands."""
    if settings.sandbox == "host":
        log.warning("YUXI_SANDBOX=host: sandbox commands run UNCONFINED on this host, as this "
                    "worker, with its environment (database URL, provider keys): unsafe, "
                    "see docs/sandbox.md")
    elif (why := confine.for_settings(settings).unavailable_reason()) is not None:
        log.warning("sandbox tools will be refused (sandbox_unavailable): %s", why)


_announce_sandbox()

# Everything the tasks run is imported now: keep the startup heap out of the
# garbage collector's walks (yuxi.heap).
freeze_startup_heap()
