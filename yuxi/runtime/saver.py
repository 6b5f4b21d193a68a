"""The checkpointer of an executing run, fenced by the run's lease.

A worker's job borrows one connection of the checkpoint pool for its runs
and marks it with the executing run's id and lease token (session settings;
start_run_v1 and complete_run_v1 do it in the transaction that takes the
lease). Triggers on LangGraph's tables (sql/110_checkpoint_fence.sql) check
the lease in each transaction that writes, so a worker that lost its lease
changes nothing, and a recovery waits for a write in flight instead of
interleaving with it. The writes themselves stay in psycopg's pipeline
mode: the fence costs no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

MARK = "SELECT yuxi.mark_checkpoint_connection_v1(%s, %s)"


@contextlib.asynccontextmanager
async def checkpoint_connection(pool: AsyncConnectionPool) -> AsyncIterator[AsyncConnection]:
    """A connection of the checkpoint pool, unmarked when it goes back (a
    worker goes on with several runs of a session on one connection, marking
    it for each). A connection that cannot be unmarked is closed, never handed
    back marked: a write cancelled mid-query (a parallel tool call stopped by
    a cancel) leaves it broken, and that must not change the run's outcome."""
    async with pool.connection() as conn:
        try:
            yield conn
        finally:
            try:
                if conn.broken or conn.closed:
                    raise psycopg.InterfaceError("connection lost")
                await conn.execute(MARK, ("", ""))
            except asyncio.CancelledError:
                await conn.close()
                raise
            except Exception as exc:
                log.warning("closing a checkpoint connection that could not be unmarked: %s",
                            exc)
                await conn.close()

