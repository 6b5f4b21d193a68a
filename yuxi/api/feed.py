"""SSE delivery: one reader of the events table per tree and API process,
writing straight into its subscribers' connections (fan-in).

A TreeFeed reads the tree's new events once per wake-up (tree-wide, after
its own high-water mark) into a window of the last YUXI_SSE_FEED_EVENTS
events, then, in the same task, hands each subscriber what follows its own
cursor: the frames go to the subscriber's ASGI `send` right there. There is
no task per subscriber on the hot path: at 500 subscribers a task wake-up,
a queue and a sender task per subscriber and batch cost more than the
frames (issue 15). Subscribers with the same cursor and filter share one
body (bytes encoded once per batch).

The window is contiguous (events commit in sequence order under the tree row
lock, so reading after the high-water mark never skips one), so a
subscriber's stream stays gap-free and without duplicates. A subscriber
whose cursor is older than the window (a replay from Last-Event-ID, or one
that fell behind) reads the table itself, in a task of its own, until it
reaches the window. With YUXI_SSE_FEED_EVENTS=0 there is no window: every
subscriber reads the table itself after each notification.

Under uvicorn a pass frames each distinct body once as an HTTP chunk and
writes it into the subscribers' transports itself (yuxi.api.direct: the
ASGI layers cost as much as the socket writes). Otherwise, and whenever a
transport's buffer is full, a send runs eagerly (as Python 3.12's eager
tasks would): uvicorn writes to the socket without suspending unless the
socket's buffer is full; only a send that has to wait (a slow client)
finishes in a task, and meanwhile that subscriber's frames collect in its
bounded buffer (YUXI_SSE_BUFFER_EVENTS).
A subscriber that cannot take new events for YUXI_SSE_SLOW_CONSUMER_SECONDS
gets `: too far behind: reconnect with Last-Event-ID: <n>` and its stream
ends. One failing subscriber never stalls the others.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import time
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from yuxi import db
from yuxi.api.direct import DirectWriter, chunk
from yuxi.errors import is_connection_error

log = logging.getLogger(__name__)

BATCH = 500
KEEPALIVE = ServerSentEventMessage(data=None, comment="keepalive").encode()
CONNECTED = ServerSentEventMessage(data=None, comment="connected", retry=1000).encode()
# YUXI_SSE_TRACE=1 logs, per feed read, where the milliseconds went: NOTIFY
# arrival -> query done -> first and last subscriber write (a diagnosis aid).
TRACE = os.environ.get("YUXI_SSE_TRACE") == "1"
if TRACE:
    import gc

    _gc_started = [0.0]

    def _gc_trace(phase: str, info: dict) -> None:
        if phase == "start":
            _gc_started[0] = time.monotonic()
        elif (pause := time.monotonic() - _gc_started[0]) > 0.002:
            log.warning("sse trace: gc generation %d took %.1f ms (%d collected; tracked: %d "
                        "in generation 2, %d frozen)", info["generation"], pause * 1000,
                        info["collected"], len(gc.get_objects(2)), gc.get_freeze_count())

    gc.callbacks.append(_gc_trace)


async def fetch(pool, tree_id: str, session_id: Any, after: int, limit: int) -> list[dict]:
    """Events of a tree (of one session, if given) after `after`, in order."""
    async with pool.connection() as conn:
        return await db.fetch_all(
            conn, "events_after",
            {"tree_id": tree_id, "after": after, "session_id": session_id, "limit": limit})


def frame(row: dict) -> bytes:
    """An event's SSE frame, encoded once: a row of the feed's window is
    shared by all of the tree's subscribers, and so is its frame."""
    encoded = row.get("_sse")
    if encoded is None:
        payload = {"seq": row["seq"], "type": row["type"], "session_id": row["session_id"],
                   "turn_id": row["turn_id"], "run_id": row["run_id"], "data": row["data"],
                   "created_at": row["created_at"]}
        encoded = row["_sse"] = ServerSentEventMessage(
            data=msgspec.json.encode(payload).decode(), id=row["seq"]).encode()
    return encoded


def delta_frame(delta: dict) -> bytes:
    """`message.delta`: no `id:` line, not stored, not replayed."""
    return ServerSentEventMessage(data=msgspec.json.encode({
        "type": "message.delta", "session_id": delta.get("session_id"),
        "turn_id": delta.get("turn_id"), "run_id": delta.get("run_id"),
        "data": {"message_id": delta.get("message_id"), "delta": delta.get("delta")},
    }).decode()).encode()


# What a delivery pass found for a (cursor, filter): nothing new, or a cursor
# behind the window (the subscriber reads the table).
_LEVEL = object()
_BEHIND = object()


async def _resume(coro, waiting) -> None:
    """Finish a send coroutine that suspended on `waiting` (the future it
    yielded) when it was stepped eagerly: wait for that future here, then
    step the coroutine on, as a task would."""
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((waiting,))
        except BaseException:
            coro.close()
            raise
        try:
            waiting = coro.send(None)
        except StopIteration:
            return


class Subscriber:
    """One SSE stream: its cursor (the last event handed to it), its filter
    (a session id, or None for the whole tree), its ASGI `send` and, under
    uvicorn, the writer into its transport."""

    def __init__(self, feeds: Feeds, tree_id: str, session_id: str | None, cursor: int,
                 send, direct: DirectWriter | None = None) -> None:
        settings = feeds.settings
        self.feeds, self.tree_id, self.only, self.cursor = feeds, tree_id, session_id, cursor
        self.send = send
        self.direct = direct
        self.capacity = max(1, settings.sse_buffer_events)
        self.slow_seconds = settings.sse_slow_consumer_seconds
        self.feed: TreeFeed | None = None
        self.pending: list[bytes] = []  # bodies not yet handed to `send`
        self.queued = 0  # frames in `pending`
        self.writing: asyncio.Task | None = None  # a send waiting for the socket
        self.catch_up: asyncio.Task | None = None  # reading the table (behind the window)
        self.poked = asyncio.Event()  # for the catch-up task: new events or room
        self.full_since: float | None = None
        self.slow_timer: asyncio.TimerHandle | None = None
        self.ending = False  # the last body is queued: take nothing more
        self.closed = False  # the last body went out (or the connection is gone)
        self.last_write = time.monotonic()

    # -- taking events ---------------------------------------------------

    def offer(self, shared: dict | None = None) -> None:
        """Take what follows the cursor from the feed's window (the feed
        calls this after each read; a drained send calls it too). `shared`
        caches one delivery pass's work by (cursor, filter): subscribers that
        were level get the same body, the same ASGI message and the same
        chunk."""
        if self.ending or self.catch_up is not None:
            return
        key = (self.cursor, self.only)
        hit = shared.get(key) if shared is not None else None
        if hit is None:
            rows = self.feed.after(self.cursor) if self.feed is not None else None
            if rows is None:
                hit = _BEHIND
            elif not rows:
                hit = _LEVEL
            else:
                frames = [frame(r) for r in rows
                          if self.only is None or str(r["session_id"]) == self.only]
                body = b"".join(frames)
                hit = (rows, body, len(frames), rows[-1]["seq"],
                       {"type": "http.response.body", "body": body, "more_body": True},
                       chunk(body))
            if shared is not None:
                shared[key] = hit
        if hit is _LEVEL:
            return
        if hit is _BEHIND:
            self._start_catch_up()
            return
        rows, body, count, last, message, framed = hit
        if self.queued + count > self.capacity:
            self.take(rows)
            return
        self.cursor = last  # the common case: room for all
        self.full_since = None
        if count:
            if self.writing is None and not self.pending and not self.closed:
                self._write(message, True, framed)
            else:
                self._push(body, count)

    def take(self, rows: list[dict]) -> int:
        """Take rows (in seq order, after the cursor) while there is room;
        returns how many were taken. Frames whose send completes at once
        free their room again: the buffer is full only while a send waits
        for the socket, and then that send's end offers again (`_written`)."""
        i, n = 0, len(rows)
        while i < n:
            room = self.capacity - self.queued
            chunks: list[bytes] = []
            while i < n:
                row = rows[i]
                if self.only is None or str(row["session_id"]) == self.only:
                    if room <= 0:
                        break
                    chunks.append(frame(row))
                    room -= 1
                self.cursor = row["seq"]
                i += 1
            if not chunks:
                break
            self._push(b"".join(chunks), len(chunks))
        if i == n:
            self._room_left()
        else:
            self._full()
        return i

    def delta(self, body: bytes) -> None:
        """A `message.delta` frame: ephemeral, dropped when the buffer is full."""
        if not self.ending and self.queued < self.capacity:
            self._push(body, 1)

    def keepalive(self, now: float) -> None:
        if (not self.ending and self.writing is None and not self.pending
                and now - self.last_write >= self.feeds.settings.sse_keepalive_seconds):
            self._push(KEEPALIVE, 0)

    # -- the slow consumer -------------------------------------------------

    def _room_left(self) -> None:
        self.full_since = None

    def _full(self) -> None:
        """New events wait for room in the buffer: if none frees up for
        YUXI_SSE_SLOW_CONSUMER_SECONDS, the client reads slower than its tree
        writes, and is closed (it resumes from the last id it got)."""
        if self.full_since is None:
            self.full_since = time.monotonic()
            if self.slow_timer is None:
                self.slow_timer = asyncio.get_running_loop().call_later(
                    self.slow_seconds, self._check_slow)

    def _check_slow(self) -> None:
        self.slow_timer = None
        if self.full_since is None or self.ending:
            return
        left = self.full_since + self.slow_seconds - time.monotonic()
        if left > 0:  # room freed up meanwhile, and filled again
            self.slow_timer = asyncio.get_running_loop().call_later(left, self._check_slow)
            return
        self.end(ServerSentEventMessage(
            data=None, comment=f"too far behind: reconnect with Last-Event-ID: "
                               f"{self.cursor}").encode())

    def end(self, last: bytes = b"") -> None:
        """Queue a last body and end the stream after the buffered frames."""
        if self.ending:
            return
        self.ending = True
        if self.catch_up is not None:
            self.catch_up.cancel()
            self.catch_up = None
        self.pending.append(last)
        self._flush()

    # -- writing -------------------------------------------------------------

    def _push(self, body: bytes, frames: int) -> None:
        self.pending.append(body)
        self.queued += frames
        self._flush()

    def _flush(self) -> None:
        if self.writing is not None or self.closed or not self.pending:
            return
        body = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
        self.pending = []
        self.queued = 0
        more = not self.ending
        self._write({"type": "http.response.body", "body": body, "more_body": more}, more)

    def _write(self, message: dict, more: bool, framed: bytes | None = None) -> None:
        """Write one body: into the transport when it takes it at once
        (`framed`: the body already as a chunk, shared by a pass), else
        through ASGI `send`. The last body (`more` false) always goes
        through `send`, which ends the response."""
        self.last_write = time.monotonic()
        body = message["body"]
        if more and body and self.direct is not None and self.direct.write(
                chunk(body) if framed is None else framed):
            return
        # Stepped eagerly: a send that does not have to wait for the socket
        # completes right here, with no task and no wake-up.
        coro = self.send(message)
        try:
            waiting = coro.send(None)
        except StopIteration:
            if not more:
                self._closed()
            return
        except Exception as exc:  # the connection is gone: this stream ends
            log.debug("SSE send failed: %r", exc)
            self._closed()
            return
        self.writing = asyncio.ensure_future(_resume(coro, waiting))
        self.writing.add_done_callback(lambda task, more=more: self._written(task, more))

    def _written(self, task: asyncio.Task, more: bool) -> None:
        self.writing = None
        if task.cancelled() or task.exception() is not None or not more:
            self._closed()
            return
        self._flush()
        # Room again: take what waited in the window (or wake the catch-up).
        self.poked.set()
        self.offer()

    def _closed(self) -> None:
        self.closed = self.ending = True
        self.pending = []
        if self.catch_up is not None:
            self.catch_up.cancel()
            self.catch_up = None

    def stop(self) -> None:
        """The connection is done: drop timers and tasks."""
        self._closed()
        if self.slow_timer is not None:
            self.slow_timer.cancel()
        if self.writing is not None:
            self.writing.cancel()

    # -- behind the window: reading the table --------------------------------

    def _start_catch_up(self) -> None:
        if self.catch_up is None and not self.ending:
            self.catch_up = asyncio.create_task(self._read_table(),
                                                name=f"sse-catch-up-{self.tree_id}")

    async def _read_table(self) -> None:
        """Read the table from the cursor until the feed's window reaches it
        (with no window: for as long as the stream lasts). The database away
        is no error: the hub wakes the feed when its LISTEN connection is
        back, the feed pokes us, and reading goes on from the cursor."""
        feeds = self.feeds
        windowed = self.feed is not None and self.feed.capacity > 0
        # With a window, read the whole tree (filtered here) so the cursor
        # reaches it; without, only the subscriber's session.
        only = None if windowed else self.only
        try:
            while True:
                self.poked.clear()  # before reading: a poke during the read wakes us again
                if self.queued >= self.capacity:
                    self._full()  # no room: wait for the send in flight (it pokes)
                    await self.poked.wait()
                    continue
                rows = None
                try:
                    # Shielded: a client disconnect must not cancel a query
                    # mid-flight (psycopg would discard the pooled connection).
                    rows = await asyncio.shield(
                        fetch(feeds.pool, self.tree_id, only, self.cursor, BATCH))
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                taken = self.take(rows) if rows else 0
                if windowed and self.feed.after(self.cursor) is not None:
                    self.catch_up = None
                    self.offer()
                    return
                if rows and taken == len(rows) and (len(rows) == BATCH or windowed):
                    continue  # more to read, or now see whether the window reaches
                await self.poked.wait()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("SSE stream of tree %s failed", self.tree_id)
            self.catch_up = None
            self.end()


class TreeFeed:
    def __init__(self, feeds: Feeds, tree_id: str) -> None:
        self.feeds, self.tree_id = feeds, tree_id
        self.pool, self.hub, self.capacity = feeds.pool, feeds.hub, feeds.capacity
        # The window: rows in ascending seq, and their seqs (for bisect).
        self.rows: list[dict] = []
        self.seqs: list[int] = []
        # The highest seq read (None until the first read).
        self.high: int | None = None
        self.subscribers: dict[int, Subscriber] = {}
        self._task: asyncio.Task | None = None

    def after(self, cursor: int) -> list[dict] | None:
        """The window's rows after `cursor`, or None when the window does not
        reach back to it (the subscriber reads the table instead)."""
        if self.high is None or self.capacity <= 0:
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

    def _deliver(self) -> None:
        """Each subscriber takes what follows its cursor, in this task; one
        failing never keeps the others from theirs."""
        shared: dict = {}
        for sub in list(self.subscribers.values()):
            try:
                sub.offer(shared)
            except Exception:
                log.exception("SSE delivery to a subscriber of tree %s failed", self.tree_id)
                # End its stream (the client resumes with Last-Event-ID), or
                # at least stop writing to it.
                try:
                    sub.end()
                except Exception:
                    sub.stop()
            if sub.catch_up is not None:
                sub.poked.set()  # reading the table: new events, or the hub is back

    def _deltas(self, deltas) -> None:
        """Deltas first: they were sent before the durable events that follow."""
        while deltas:
            delta = deltas.popleft()
            body = delta_frame(delta)
            session = delta.get("session_id")
            for sub in list(self.subscribers.values()):
                if sub.only is None or sub.only == session:
                    sub.delta(body)

    async def run(self) -> None:
        keepalive = self.feeds.settings.sse_keepalive_seconds
        # Keepalives: a scan every half period, so an idle stream gets one
        # after 1 to 1.5 periods.
        scan_every = max(0.05, keepalive / 2)
        next_scan = time.monotonic() + scan_every
        with self.hub.subscribe(self.tree_id) as wake, \
                self.hub.subscribe_deltas(self.tree_id, wake) as deltas:
            # The tree's transactions notify only while it is watched: the
            # watch commits before the first read.
            async with self.hub.watching(self.tree_id):
                await self._follow(wake, deltas, scan_every, next_scan)

    async def _follow(self, wake: asyncio.Event, deltas, scan_every: float,
                      next_scan: float) -> None:
        """Read and deliver at each wake-up, and send keepalives, until cancelled."""
        while True:
            wake.clear()  # before reading: a NOTIFY during the read wakes us again
            woke = time.monotonic()
            self._deltas(deltas)
            rows = None
            if self.capacity > 0:
                try:
                    if self.high is None:
                        # Start from now: older events are replays, which
                        # their subscribers read from the table.
                        self.high = await _last_seq(self.pool, self.tree_id)
                    rows = await asyncio.shield(
                        fetch(self.pool, self.tree_id, None, self.high, BATCH))
                except Exception as exc:
                    if not is_connection_error(exc):
                        log.exception("event feed of tree %s failed", self.tree_id)
                    # read again when the hub wakes us (it does after a reconnect)
                if rows:
                    self._append(rows)
            read = time.monotonic()
            self._deliver()
            if TRACE and rows:
                done = time.monotonic()
                noted = self.hub.noted_at.get(self.tree_id, woke)
                log.warning("sse trace: %d events, %d subscribers; NOTIFY->feed awake "
                            "%.2f ms, read %.2f ms, delivery %.2f ms", len(rows),
                            len(self.subscribers), (woke - noted) * 1000,
                            (read - woke) * 1000, (done - read) * 1000)
            if rows and len(rows) == BATCH:
                continue
            while True:
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + scan_every
                    for sub in list(self.subscribers.values()):
                        sub.keepalive(now)
                try:
                    async with asyncio.timeout(next_scan - now):
                        await wake.wait()
                    break
                except TimeoutError:
                    continue


async def _last_seq(pool, tree_id: str) -> int:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "last_event_seq", {"tree_id": tree_id})
    return row["seq"]


class Feeds:
    """The process's TreeFeeds, one per tree with at least one subscriber."""

    def __init__(self, pool, hub, settings) -> None:
        self.pool, self.hub, self.settings = pool, hub, settings
        self.capacity = settings.sse_feed_events
        self._feeds: dict[str, TreeFeed] = {}

    def subscriber_count(self) -> int:
        """Open SSE streams of this process (a metric)."""
        return sum(len(feed.subscribers) for feed in self._feeds.values())

    @contextlib.contextmanager
    def subscribe(self, sub: Subscriber):
        """Attach `sub` to its tree's feed; it takes events from now on."""
        tree_id = sub.tree_id
        feed = self._feeds.get(tree_id)
        if feed is None:
            feed = self._feeds[tree_id] = TreeFeed(self, tree_id)
            feed._task = asyncio.create_task(feed.run(), name=f"event-feed-{tree_id}")
        feed.subscribers[id(sub)] = sub
        sub.feed = feed
        try:
            sub.offer()  # a replay (or the window's tail) starts now
            yield sub
        finally:
            sub.stop()
            feed.subscribers.pop(id(sub), None)
            if not feed.subscribers and self._feeds.get(tree_id) is feed:
                del self._feeds[tree_id]
                if feed._task is not None:
                    feed._task.cancel()
