"""One reader of the events table per tree and API process, shared by all of
the tree's SSE subscribers on it (fan-in).

Without it every subscriber re-read the table after each NOTIFY: 500
subscribers of one session made 500 queries per event batch. A TreeFeed
reads the tree's new events once per wake-up (tree-wide, after its own
high-water mark) into a window of the last YUXI_SSE_FEED_EVENTS events, then
wakes its subscribers, which take what follows their own cursor from that
window. The window is contiguous (events commit in sequence order under the
tree row lock, so reading after the high-water mark never skips one), so a
subscriber's stream stays gap-free and without duplicates. A subscriber
whose cursor is older than the window (a replay from Last-Event-ID, or one
that fell behind) reads the table itself until it reaches the window.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from typing import Any

from yuxi import db
from yuxi.errors import is_connection_error

log = logging.getLogger(__name__)

BATCH = 500


async def fetch(pool, tree_id: str, session_id: Any, after: int, limit: int) -> list[dict]:
    """Events of a tree (of one session, if given) after `after`, in order."""
    async with pool.connection() as conn:
        return await db.fetch_all(
            conn, "events_after",
            {"tree_id": tree_id, "after": after, "session_id": session_id, "limit": limit})


class TreeFeed:
    def __init__(self, pool, hub, tree_id: str, capacity: int) -> None:
        self.pool, self.hub, self.tree_id, self.capacity = pool, hub, tree_id, capacity
        # The window: rows in ascending seq, and their seqs (for bisect).
        self.rows: list[dict] = []
        self.seqs: list[int] = []
        # The highest seq read (None until the first read).
        self.high: int | None = None
        self.subscribers: set[asyncio.Event] = set()
        self._task: asyncio.Task | None = None

    def after(self, cursor: int) -> list[dict] | None:
        """The window's rows after `cursor`, or None when the window does not
        reach back to it (the caller reads the table instead)."""
        if self.high is None:
            return None
        first = self.seqs[0] if self.seqs else self.high + 1
        if cursor < first - 1:
            return None
        return self.rows[bisect.bisect_right(self.seqs, cursor):]

    def _append(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        self.seqs.extend(r["seq"] for r in rows)
        self.high = rows[-1]["seq"]
        if len(self.rows) > 2 * self.capacity:  # trim in halves: amortized O(1)
            del self.rows[:-self.capacity], self.seqs[:-self.capacity]

    def _wake_subscribers(self) -> None:
        for wake in self.subscribers:
            wake.set()

    async def run(self) -> None:
        with self.hub.subscribe(self.tree_id) as wake:
            while True:
                wake.clear()  # before reading: a NOTIFY during the read wakes us again
                try:
                    if self.high is None:
                        # Start from now: older events are replays, which
                        # their subscribers read from the table.
                        self.high = await _last_seq(self.pool, self.tree_id)
                        self._wake_subscribers()
                    rows = await asyncio.shield(
                        fetch(self.pool, self.tree_id, None, self.high, BATCH))
                except Exception as exc:
                    if not is_connection_error(exc):
                        log.exception("event feed of tree %s failed", self.tree_id)
                    rows = None  # read again when the hub wakes us (it does after a reconnect)
                if rows:
                    self._append(rows)
                    self._wake_subscribers()
                    if len(rows) == BATCH:
                        continue
                await wake.wait()


async def _last_seq(pool, tree_id: str) -> int:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "last_event_seq", {"tree_id": tree_id})
    return row["seq"]


class Feeds:
    """The process's TreeFeeds, one per tree with at least one subscriber."""

    def __init__(self, pool, hub, capacity: int) -> None:
        self.pool, self.hub, self.capacity = pool, hub, capacity
        self._feeds: dict[str, TreeFeed] = {}
        # Open subscriptions (SSE streams) of this process: a metric.
        self.subscribers = 0

    def subscriber_count(self) -> int:
        return self.subscribers

    @contextlib.contextmanager
    def subscribe(self, tree_id: str, wake: asyncio.Event):
        """The tree's feed (None when disabled: capacity 0); `wake` is set
        whenever the feed has read new events."""
        self.subscribers += 1
        try:
            if self.capacity <= 0:
                with self.hub.subscribe(tree_id) as hub_wake:
                    yield None, hub_wake
            else:
                with self._feed(tree_id, wake) as feed:
                    yield feed, wake
        finally:
            self.subscribers -= 1

    @contextlib.contextmanager
    def _feed(self, tree_id: str, wake: asyncio.Event):
        feed = self._feeds.get(tree_id)
        if feed is None:
            feed = self._feeds[tree_id] = TreeFeed(self.pool, self.hub, tree_id, self.capacity)
            feed._task = asyncio.create_task(feed.run(), name=f"event-feed-{tree_id}")
        feed.subscribers.add(wake)
        try:
            yield feed
        finally:
            feed.subscribers.discard(wake)
            if not feed.subscribers and self._feeds.get(tree_id) is feed:
                del self._feeds[tree_id]
                if feed._task is not None:
                    feed._task.cancel()
