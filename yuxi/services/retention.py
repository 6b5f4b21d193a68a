"""Event retention: `yuxi events prune --before T` (docs/operator-guide.md).

The events table grows with every step of every turn. Pruning deletes, tree
by tree (one short transaction each), the events created before T that no
reader still needs: yuxi.prune_tree_events_v1 keeps each tree's last event
(numbers continue after it), the facts waits consume, and the whole log of a
tree with a turn in flight.

Also the watches (yuxi.event_watches) of listening backends that are gone:
the recovery sweep drops them (`forget_gone_watches`).
"""

from __future__ import annotations

import datetime as dt

from psycopg_pool import AsyncConnectionPool

from yuxi import db


async def prune_events(pool: AsyncConnectionPool, before: dt.datetime) -> tuple[int, int]:
    """Returns (trees looked at, events deleted)."""
    async with pool.connection() as conn:
        trees = [r["id"] for r in await db.fetch_all(conn, "trees_with_events_before",
                                                     {"before": before})]
    deleted = 0
    for tree_id in trees:
        async with pool.connection() as conn:
            row = await db.fetch_one(conn, "prune_tree_events",
                                     {"tree_id": tree_id, "before": before})
        deleted += row["deleted"]
    return len(trees), deleted


async def forget_gone_watches(pool: AsyncConnectionPool) -> int:
    """Drop the event watches of backends that are gone (an API process that
    died, a psql session that ended): they only cost notifications nobody
    reads. Returns how many went."""
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "forget_watches", {"pid": None}))["forgotten"]
