"""Worker-side transitions of runs. Each call is one transaction, fenced by the
run's lease token where the worker acts on a run it executes."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi import db


async def start_run(
    source: AsyncConnectionPool | AsyncConnection, run_id: uuid.UUID, token: uuid.UUID,
    lease_seconds: float, *, mark: bool = False, host: str | None = None,
    job_id: int | None = None, claimer: int | None = None,
) -> dict[str, Any] | None:
    """Take the lease of a ready run; None when the run is not ready (a stale
    or duplicate job). `mark`: `source` is the run's checkpoint connection,
    marked with the lease in the same transaction. `job_id`: the run's job,
    removed from the queue with the lease (a claim on `yuxi_ready`).
    `claimer`: the leasing worker's, when it claims (runs.claimer)."""
    query, params = _lease(run_id, token, lease_seconds, mark, host, job_id, claimer)
    async with db.connection(source) as conn:
        return await db.fetch_one(conn, query, params)


def _lease(run_id: uuid.UUID, token: uuid.UUID, lease_seconds: float, mark: bool,
           host: str | None, job_id: int | None,
           claimer: int | None) -> tuple[str, dict[str, Any]]:
    """The statement that takes a run's lease: a claim's (its job removed
    with it) or a job's."""
    params = {"run_id": run_id, "token": token, "lease_seconds": lease_seconds, "mark": mark,
              "host": host, "claimer": claimer}
    if job_id is None:
        return "start_run", params
    return "claim_run", {**params, "job_id": job_id}


async def start_run_reading(
    conn: AsyncConnection, run_id: uuid.UUID, token: uuid.UUID, lease_seconds: float,
    reads: Sequence[tuple[str, Any]], *, mark: bool = False, host: str | None = None,
    job_id: int | None = None, claimer: int | None = None,
) -> tuple[dict[str, Any] | None, list[list[dict[str, Any]]]]:
    """`start_run`, and `reads` ((query, params), run in binary) in the
    same round trip (one pipeline): what the run reads first, known by the
    run's id alone. Their rows are worth nothing when no run is returned.
    The reads go first: the lease takes the tree's lock, held until the
    pipeline commits, and a tree's claims, completions and events queue
    for it (a fan-out's first children and its root's tool results, at
    once). Nothing writes a ready run's thread meanwhile (no lease is
    held in its session), so they read what they would read after it."""
    query, params = _lease(run_id, token, lease_seconds, mark, host, job_id, claimer)
    with db.domain_errors():
        async with conn.pipeline():
            cursors = [await conn.cursor(binary=True, row_factory=dict_row).execute(
                           q, p, binary=True) for q, p in reads]
            lease = await conn.execute(db.QUERIES[query], params)
        run = await lease.fetchone()
        return run, [await cur.fetchall() for cur in cursors]


async def heartbeat(
    pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID, lease_seconds: float
) -> bool:
    async with pool.connection() as conn:
        row = await db.fetch_one(
            conn, "heartbeat_run",
            {"run_id": run_id, "token": token, "lease_seconds": lease_seconds},
        )
    return bool(row["held"])


def emit_params(run_id: uuid.UUID, token: uuid.UUID, type_: str, data: dict[str, Any],
                dedupe_key: str | None) -> dict[str, Any]:
    """The parameters of `emit_run_event` (a run's event, fenced by its lease)."""
    return {"run_id": run_id, "token": token, "type": type_, "data": Jsonb(data),
            "dedupe_key": dedupe_key}


async def emit(
    pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID,
    type_: str, data: dict[str, Any], dedupe_key: str | None,
) -> int | None:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "emit_run_event",
                                 emit_params(run_id, token, type_, data, dedupe_key))
    return row["seq"]


async def complete(
    source: AsyncConnectionPool | AsyncConnection, run_id: uuid.UUID, token: uuid.UUID,
    output: dict[str, Any], delivered: list[uuid.UUID] = (), *,
    next_token: uuid.UUID | None = None, lease_seconds: float | None = None,
    events: list[dict[str, Any]] = (), mark: bool = False,
    archive: dict[str, list[Any]] | None = None, saver: Any = None,
) -> tuple[str, dict[str, Any] | None]:
    """Complete the run and its turn: 'completed'; 'steer' (nothing changed)
    when the turn took in a steer that is not among `delivered` (deliver it
    first); 'cancelled' when a cancel intent was committed before. `events`
    ({type, data, dedupe_key}) are recorded first, whatever the outcome.

    With `next_token`, a run this completion gives a slot to (the tree's
    oldest pending run, else the parent whose wait it satisfies, else the
    session's next queued turn), when it may run on this run's host, comes
    back leased with that token (as `start_run` returns it) and gets no job:
    the caller must execute it (`mark`: as in `start_run`). When no run of
    the tree takes it, the oldest ready run whose job is due in this
    worker's queues comes back instead, its job deleted.

    `archive` (conversation.archive_params of the turn's messages) joins the
    conversation archive when the turn completes, in the same transaction.

    `saver` (yuxi.runtime.saver.RunSaver, on `source`): the run's held
    checkpoint writes go out with the completion, in one transaction."""
    archive = archive or {}
    params = {"run_id": run_id, "token": token, "output": Jsonb(output),
              "delivered": list(delivered), "next_token": next_token,
              "lease_seconds": lease_seconds, "events": Jsonb(list(events)), "mark": mark,
              **{f"archive_{k}": archive.get(k) for k in ("ids", "turns", "serde", "messages")}}
    return await _leaving(source, saver, "complete_run", params)


async def fetch_one_after_held(source: AsyncConnectionPool | AsyncConnection, saver: Any,
                               name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The first row of query `name`: on the run saver's pipeline, after what
    it holds (yuxi.runtime.saver.RunSaver.write_with: they commit together),
    else on `source`."""
    if saver is not None:
        with db.domain_errors():
            return await saver.write_with(db.QUERIES[name], params)
    async with db.connection(source) as conn:
        return await db.fetch_one(conn, name, params)


async def _leaving(source: AsyncConnectionPool | AsyncConnection, saver: Any, name: str,
                   params: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """A run's completion or suspension (`name`): its outcome, and the run it
    handed over to the caller (a leased_run row) or None."""
    row = await fetch_one_after_held(source, saver, name, params)
    outcome = row.pop("outcome")
    return outcome, (row if row["id"] is not None else None)


async def cancel_requested(pool: AsyncConnectionPool, turn_id: uuid.UUID) -> bool:
    async with pool.connection() as conn:
        return bool((await db.fetch_one(conn, "cancel_requested",
                                        {"turn_id": turn_id}))["requested"])


async def cancel_run(pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID) -> None:
    async with pool.connection() as conn:
        await db.execute(conn, "cancel_run", {"run_id": run_id, "token": token})


async def redeliver_cleanups(pool: AsyncConnectionPool, older_than: dt.timedelta) -> int:
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "redeliver_cleanups", {"older_than": older_than}))["n"]


async def boundary(pool: AsyncConnectionPool, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Cancel intent, steers and messages a run meets before a model call."""
    async with pool.connection() as conn:
        return await db.fetch_all(conn, "boundary", {
            "turn_id": run["turn_id"], "input_id": run["input_id"],
            "session_id": run["session_id"]})


async def mark_messages_processed(pool: AsyncConnectionPool, run_id: uuid.UUID,
                                  token: uuid.UUID, message_ids: list[uuid.UUID]) -> int:
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "mark_messages_processed", {
            "run_id": run_id, "token": token, "message_ids": message_ids}))["marked"]


async def mark_steers_delivered(
    pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID, input_ids: list[uuid.UUID]
) -> int:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "mark_steers_delivered",
                                 {"run_id": run_id, "token": token, "input_ids": input_ids})
    return row["marked"]


async def fail(pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID, error: str) -> None:
    async with pool.connection() as conn:
        await db.execute(conn, "fail_run", {"run_id": run_id, "token": token, "error": error})


async def suspend(
    source: AsyncConnectionPool | AsyncConnection, run_id: uuid.UUID, token: uuid.UUID,
    kind: str, targets: list[uuid.UUID], cursor: dict[str, int], timeout_s: float, *,
    next_token: uuid.UUID | None = None, lease_seconds: float | None = None,
    mark: bool = False, saver: Any = None,
) -> tuple[str, dict[str, Any] | None]:
    """Suspend the run on a wait: 'suspended', or 'ready' / 'cycle' when the
    run must go on at once. With `next_token`, the run the released slot
    goes to (or a queued run) comes back leased, as
    from `complete` (then the caller must execute it); `saver`: the run's
    held checkpoint writes go out first, in the same transaction."""
    params = {"run_id": run_id, "token": token, "kind": kind, "targets": targets,
              "cursor": Jsonb(cursor), "timeout": timeout_s, "next_token": next_token,
              "lease_seconds": lease_seconds, "mark": mark}
    return await _leaving(source, saver, "suspend_run", params)


async def suspend_for_user(source: AsyncConnectionPool | AsyncConnection, run_id: uuid.UUID,
                           token: uuid.UUID, kind: str, request: dict[str, Any], *,
                           saver: Any = None) -> uuid.UUID:
    """Suspend the run until its user answers (`saver`: the run's held
    checkpoint writes, its interrupt, go out first, in the same transaction)."""
    return (await fetch_one_after_held(source, saver, "suspend_for_user", {
        "run_id": run_id, "token": token, "kind": kind, "request": Jsonb(request)}))["wait_id"]


async def resume_wait(pool: AsyncConnectionPool, wait_id: uuid.UUID) -> uuid.UUID | None:
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "resume_wait", {"wait_id": wait_id}))["run_id"]


async def expire_wait(pool: AsyncConnectionPool, wait_id: uuid.UUID) -> bool:
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "expire_wait", {"wait_id": wait_id}))["expired"]


async def redeliver_waits(pool: AsyncConnectionPool, grace: dt.timedelta) -> int:
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "redeliver_waits", {"grace": grace}))["n"]


async def recover_expired(pool: AsyncConnectionPool, max_attempts: int,
                          max_infra_retries: int = 20) -> list[uuid.UUID]:
    """Recover every run whose lease expired, one transaction per run (each
    takes its own tree lock). Returns the runs recovered."""
    async with pool.connection() as conn:
        expired = [r["id"] for r in await db.fetch_all(conn, "expired_runs")]
        for run_id in expired:
            await db.fetch_one(
                conn, "recover_run", {"run_id": run_id, "max_attempts": max_attempts,
                                      "max_infra_retries": max_infra_retries})
    return expired


async def report_infra_fault(pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID,
                             error: str) -> bool:
    """Report that the run was cut off by a database connection fault (see
    yuxi.report_run_infra_fault_v1); False when its lease is not held any more."""
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "report_run_infra_fault",
                                 {"run_id": run_id, "token": token, "error": error})
    return bool(row["reported"])


async def redeliver_ready(pool: AsyncConnectionPool, older_than: dt.timedelta) -> list[uuid.UUID]:
    """Re-defer jobs of ready runs that have none (lost between commit and
    pickup, or their worker died before taking the lease)."""
    async with pool.connection() as conn:
        rows = await db.fetch_all(conn, "redeliver_ready_runs", {"older_than": older_than})
    return [r["run_id"] for r in rows]


async def yield_run(pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID) -> str:
    """Give a leased run back to the host holding its tree's live sandbox
    (the claim met YX008): ready again, its job on that host's queue."""
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "yield_run", {"run_id": run_id, "token": token}))["queue"]


async def host_heartbeat(pool: AsyncConnectionPool, host: str) -> None:
    async with pool.connection() as conn:
        await db.execute(conn, "host_heartbeat", {"host": host})


async def release_dead_hosts(pool: AsyncConnectionPool, timeout: dt.timedelta) -> int:
    """Release the sandboxes of hosts whose heartbeat expired and move their
    queued runs to the shared queue; returns the sandboxes released."""
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "release_dead_hosts", {"timeout": timeout}))["released"]
