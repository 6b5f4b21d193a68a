"""The Procrastinate app of Yuxi sessions, run by `python -m workers.run` (which
`yuxi worker` supervises; `procrastinate --app=workers.app.app worker` works
too but exits when the database goes away). Its tables live in their own
schema (`procrastinate`)."""

from __future__ import annotations

import logging

import procrastinate

from yuxi import db
from yuxi.runtime.providers import check_configured
from yuxi.settings import Settings

settings = Settings.from_env()
check_configured()  # a bad YUXI_PROVIDERS stops the worker now

# This host's own queue: runs of trees whose sandbox lives on this host's
# disk, and the host's own periodic jobs (sql/120_hosts.sql).
HOST_QUEUE = f"runs@{settings.host_id}"

# Two INFO lines per job cost measurable CPU at hundreds of runs per second;
# our own log lines say what a run did.
logging.getLogger("procrastinate").setLevel(logging.WARNING)

class WorkerApp(procrastinate.App):
    """Procrastinate's app, whose worker opens this process's executor as it
    starts (workers.tasks.start_executor), not at the first job it happens
    to fetch: its claims of ready runs (`yuxi_ready`) begin with the worker.
    Opened lazily, a worker whose peers claimed every run never got a job,
    so it never claimed either, and one process ran every run."""

    async def run_worker_async(self, **kwargs) -> None:  # type: ignore[override]
        from workers import tasks

        tasks.start_executor()
        await super().run_worker_async(**kwargs)


class WorkerConnector(procrastinate.PsycopgConnector):
    """Procrastinate's connector, except that its worker hears its job
    notifications on this process's one LISTEN connection (the executor's
    WorkerListener, which also hears cancels and ready runs), not on one of
    its own: PostgreSQL wakes every listening backend of the database at
    each notifying commit, whatever the channel (benchmarks/README.md).
    Until the executor opens (at the worker's start, or at its first job),
    Procrastinate finds its jobs by polling."""

    async def listen_notify(self, on_notification, channels) -> None:  # type: ignore[override]
        from workers import tasks

        await tasks.relay_notifications(channels, on_notification)


app = WorkerApp(
    connector=WorkerConnector(
        # The server itself, never a transaction pooler: psycopg prepares
        # statements (the LISTEN is the executor's, WorkerConnector).
        conninfo=db.with_search_path(settings.session_database_url, db.PROCRASTINATE_SCHEMA),
        min_size=1,
        max_size=4,
        # Reconnect within seconds of the database coming back (yuxi.db).
        reconnect_timeout=db.RECONNECT_TIMEOUT,
    ),
    import_paths=["workers.tasks"],
    worker_defaults={
        "queues": ["runs", "maintenance", HOST_QUEUE],
        "concurrency": settings.worker_concurrency,
        # NOTIFY wakes idle workers at once for a job due now; polling finds
        # the rest: scheduled jobs (the recovery sweep), missed notifications,
        # and the job of a ready run that its claimer left (busy, just died),
        # due 20 ms after its announcement and inserted without a wake-up
        # (defer_run_job_v1, sql/020_slots.sql): this bounds how long it
        # waits then.
        "fetch_job_polling_interval": 0.25,
        "delete_jobs": "successful",
        "update_heartbeat_interval": 2.0,
        "stalled_worker_timeout": 10.0,
    },
)
