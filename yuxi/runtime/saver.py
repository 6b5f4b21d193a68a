"""A LangGraph checkpointer whose writes are fenced by the run's lease.

Every checkpoint or pending-write commit first runs `yuxi.check_lease_v1` in
the same transaction: it raises when the lease is lost and otherwise keeps the
run row share-locked until the write commits, so a recovery that takes the
turn over waits for it and is never interleaved with a zombie's write.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from yuxi import db


class FencedSaver(AsyncPostgresSaver):
    def __init__(self, pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID) -> None:
        # One saver per run: the base class serializes its I/O with one lock,
        # which would serialize every run of a worker if shared.
        super().__init__(pool)
        self.run_id = run_id
        self.token = token

    @contextlib.asynccontextmanager
    async def _cursor(self, *, pipeline: bool = False) -> AsyncIterator:
        if not pipeline:  # reads are not fenced
            async with super()._cursor(pipeline=False) as cur:
                yield cur
            return
        async with self.lock, self.conn.connection() as conn, conn.transaction():
            async with conn.cursor(binary=True, row_factory=dict_row) as cur:
                with db.domain_errors():
                    await cur.execute(
                        db.QUERIES["check_lease"], {"run_id": self.run_id, "token": self.token}
                    )
                yield cur
