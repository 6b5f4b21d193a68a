"""Prometheus metrics (prometheus-client): `GET /metrics` of each API
process, and each worker process's own port (YUXI_WORKER_METRICS_PORT).

Two kinds of figures:
- from the database, read at each scrape of an API process (the operator
  guide shows the psql behind each): queue depth per Procrastinate queue,
  pending runs per tree, slots in use, stuck runs;
- observed by this process: SSE subscribers (API); run and turn durations,
  wake latency, provider call latency and errors, recoveries (worker).

docs/operator-guide.md ("Metrics") lists every name with its query.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, start_http_server)

from yuxi import db

log = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "DatabaseGauges", "ModelCallMetrics", "WorkerMetrics",
           "render"]

# Seconds: from a fast replay turn to a long model turn.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DatabaseGauges:
    """Figures read from PostgreSQL at each scrape (named queries metrics_*)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge("yuxi_queue_depth", "Procrastinate jobs waiting (todo) per queue",
                                 ["queue"], registry=registry)
        self.pending_runs = Gauge("yuxi_pending_runs", "runs waiting for a slot, per tree",
                                  ["tree_id"], registry=registry)
        self.slots_in_use = Gauge("yuxi_slots_in_use", "slots held by runs, all trees",
                                  registry=registry)
        self.trees_at_capacity = Gauge("yuxi_trees_at_capacity",
                                       "trees whose slots are all held", registry=registry)
        self.stuck_runs = Gauge(
            "yuxi_stuck_runs", "runs recovery will act on: running with an expired lease, "
            "or ready for 30 s without a job", ["kind"], registry=registry)
        self.scrape_errors = Counter("yuxi_metrics_database_errors",
                                     "scrapes whose database figures failed", registry=registry)

    async def refresh(self, pool) -> None:
        try:
            async with pool.connection() as conn:
                queues = await db.fetch_all(conn, "metrics_queue_depth")
                pending = await db.fetch_all(conn, "metrics_pending_runs")
                slots = await db.fetch_one(conn, "metrics_slots")
                stuck = await db.fetch_one(conn, "metrics_stuck_runs")
        except Exception:
            log.exception("metrics: database figures unavailable")
            self.scrape_errors.inc()
            return
        self.queue_depth.clear()
        for row in queues:
            self.queue_depth.labels(row["queue"]).set(row["n"])
        self.pending_runs.clear()
        for row in pending:
            self.pending_runs.labels(str(row["tree_id"])).set(row["n"])
        self.slots_in_use.set(slots["held"])
        self.trees_at_capacity.set(slots["full_trees"])
        self.stuck_runs.labels("lease_expired").set(stuck["lease_expired"])
        self.stuck_runs.labels("ready_without_job").set(stuck["ready_without_job"])


class ApiMetrics:
    """The registry of one API process (app.state.metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.database = DatabaseGauges(self.registry)
        self.sse_subscribers = Gauge("yuxi_sse_subscribers",
                                     "open SSE streams of this API process",
                                     registry=self.registry)

    async def render(self, pool, feeds) -> bytes:
        await self.database.refresh(pool)
        self.sse_subscribers.set(feeds.subscriber_count())
        return generate_latest(self.registry)


class WorkerMetrics:
    """Figures a worker process observes (one instance per process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.run_duration = Histogram("yuxi_run_duration_seconds",
                                      "a run's execution, lease to its end, by outcome",
                                      ["outcome"], buckets=DURATION_BUCKETS, registry=r)
        self.turn_duration = Histogram("yuxi_turn_duration_seconds",
                                       "a turn's life, created to ended, by status",
                                       ["status"], buckets=DURATION_BUCKETS, registry=r)
        self.wake_latency = Histogram(
            "yuxi_wake_latency_seconds",
            "from a run's creation (a new turn, a resume after a wait or an answer, a retry) "
            "to a worker taking its lease", ["kind"], buckets=LATENCY_BUCKETS, registry=r)
        self.model_latency = Histogram("yuxi_provider_call_seconds",
                                       "model (provider) call latency", ["provider"],
                                       buckets=DURATION_BUCKETS, registry=r)
        self.model_errors = Counter("yuxi_provider_call_errors",
                                    "model (provider) calls that raised", ["provider"],
                                    registry=r)
        self.recoveries = Counter("yuxi_recoveries",
                                  "what the recovery sweep of this worker did, by kind",
                                  ["kind"], registry=r)

    def serve(self, port: int) -> None:
        """The worker's /metrics on `port` (a thread of this process)."""
        start_http_server(port, registry=self.registry)
        log.info("metrics on port %s", port)

    def run_started(self, run: dict[str, Any]) -> None:
        kind = "resume" if run.get("resume") else "retry" if run.get("attempt", 1) > 1 else "turn"
        created = run.get("created_at")
        started = run.get("started_at")
        if created is not None and started is not None:
            self.wake_latency.labels(kind).observe(max(0.0, (started - created).total_seconds()))

    def run_ended(self, outcome: str, seconds: float) -> None:
        self.run_duration.labels(outcome).observe(seconds)

    async def turn_maybe_ended(self, pool, turn_id: uuid.UUID) -> None:
        async with pool.connection() as conn:
            row = await db.fetch_one(conn, "metrics_turn_duration", {"turn_id": turn_id})
        if row is not None:
            self.turn_duration.labels(row["status"]).observe(row["seconds"])

    def recovered(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            if n:
                self.recoveries.labels(kind).inc(n)


class ModelCallMetrics(AsyncCallbackHandler):
    """LangChain callbacks timing each chat model call of a run's graph."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._started: dict[uuid.UUID, tuple[float, str]] = {}

    async def on_chat_model_start(self, serialized, messages, *, run_id, metadata=None,
                                  **kwargs) -> None:
        provider = (metadata or {}).get("ls_provider") or (serialized or {}).get("name") or "?"
        self._started[run_id] = (time.monotonic(), str(provider))

    async def on_llm_end(self, response, *, run_id, **kwargs) -> None:
        if (start := self._started.pop(run_id, None)) is not None:
            self.metrics.model_latency.labels(start[1]).observe(time.monotonic() - start[0])

    async def on_llm_error(self, error, *, run_id, **kwargs) -> None:
        if (start := self._started.pop(run_id, None)) is not None:
            self.metrics.model_latency.labels(start[1]).observe(time.monotonic() - start[0])
            self.metrics.model_errors.labels(start[1]).inc()


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
