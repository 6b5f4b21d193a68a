"""The checkpointer of an executing run, fenced by the run's lease.

The run borrows one connection of the checkpoint pool for its whole
execution and marks it with its run id and lease token (session settings).
Triggers on LangGraph's tables (sql/110_checkpoint_fence.sql) check the lease
in the statement that writes, so a worker that lost its lease changes
nothing, and a recovery waits for a write in flight instead of interleaving
with it. The writes themselves stay in psycopg's pipeline mode: the fence
costs no round trip.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

MARK = "SELECT set_config('yuxi.run_id', %s, false), set_config('yuxi.lease_token', %s, false)"


@contextlib.asynccontextmanager
async def checkpoint_connection(pool: AsyncConnectionPool) -> AsyncIterator[AsyncConnection]:
    """A connection of the checkpoint pool, unmarked when it goes back (a
    worker goes on with several runs of a session on one connection, marking
    it for each)."""
    async with pool.connection() as conn:
        try:
            yield conn
        finally:
            try:
                await conn.execute(MARK, ("", ""))
            except BaseException:
                # Cancelled or broken: never hand a marked connection back.
                await conn.close()
                raise


async def mark(conn: AsyncConnection, run_id: uuid.UUID, token: uuid.UUID) -> AsyncPostgresSaver:
    """Mark the connection with the run's lease; its checkpointer."""
    await conn.execute(MARK, (str(run_id), str(token)))
    return AsyncPostgresSaver(conn)


@contextlib.asynccontextmanager
async def fenced_saver(pool: AsyncConnectionPool, run_id: uuid.UUID,
                       token: uuid.UUID) -> AsyncIterator[AsyncPostgresSaver]:
    """A checkpointer on a connection marked with the run's lease."""
    async with checkpoint_connection(pool) as conn:
        yield await mark(conn, run_id, token)
