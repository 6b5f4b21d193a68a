"""One LISTEN connection per API process, fanned out to SSE subscribers
and to requests waiting for a turn's end.

`yuxi_events` payloads carry the tree id only (one per transaction); a
woken tree feed (yuxi.api.feed) re-reads the events table after its
high-water mark, so a lost or collapsed notification costs latency, never an
event. `yuxi_turns` payloads are the ids of turns that ended (completed,
failed, cancelled); a woken waiter reads its turn. After a (re)connect every
subscriber is woken, since notifications sent while disconnected are gone.

A tree's transactions send `yuxi_events` (and its deltas go out) only while
some listener watches it (yuxi.event_watches, sql/010_events.sql): the hub
keeps a watch, under its LISTEN connection's backend pid, for each tree a
feed follows (`watching`), and registers them all again from a new
connection before it listens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections import defaultdict

import msgspec
from psycopg.conninfo import make_conninfo

from yuxi import db
from yuxi.errors import is_connection_error

log = logging.getLogger(__name__)

CHANNEL = "yuxi_events"
TURN_CHANNEL = "yuxi_turns"
# The LISTEN connection's application_name: operators count the API
# processes listening in pg_stat_activity (docs/operator-guide.md).
LISTENER_NAME = "yuxi-events"
# Ephemeral text deltas of streaming models (yuxi.runtime.live): fanned out
# as they come, never stored; a slow subscriber drops the oldest.
DELTA_CHANNEL = "yuxi_deltas"
DELTA_BUFFER = 1000
TRACE = os.environ.get("YUXI_SSE_TRACE") == "1"


class EventHub:
    def __init__(self, url: str, pool, *, poll_seconds: float = 5.0) -> None:
        self.url = url
        self.pool = pool  # where watches are registered while listening
        self.poll_seconds = poll_seconds
        self.connected = False
        # Watches: how many feeds of this process follow each tree, the trees
        # registered under the LISTEN connection's backend (`_pid`, None while
        # not listening) and the previous backend (its watches go at a reconnect).
        self._watchers: dict[str, int] = {}
        self._watched: set[str] = set()
        self._pid: int | None = None
        self._last_pid: int | None = None
        self._watch_lock = asyncio.Lock()
        self._unwatching: set[asyncio.Task] = set()
        self._subscribers: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._turn_subscribers: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._delta_subscribers: dict[str, dict[int, tuple[collections.deque, asyncio.Event]]] = \
            defaultdict(dict)
        self._task: asyncio.Task | None = None
        # YUXI_SSE_TRACE=1: when each tree's last NOTIFY arrived (yuxi.api.feed).
        self.noted_at: dict[str, float] = {}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen_forever(), name="yuxi-event-hub")

    async def stop(self) -> None:
        for task in list(self._unwatching):
            task.cancel()  # the LISTEN backend ends: forget_watches_v1 drops its rows
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def subscribe(self, tree_id: str):
        """An Event set whenever the tree may have new events."""
        with _member(self._subscribers, tree_id) as wake:
            yield wake

    @contextlib.asynccontextmanager
    async def watching(self, tree_id: str):
        """The tree's event transactions notify while the block runs: the
        tree's watch is committed before the block starts (so a read of the
        tree's events in the block misses no later notification) or, while
        the hub is not listening, is registered when it listens again (and
        then wakes every subscriber). The last watcher's exit drops it."""
        self._watchers[tree_id] = self._watchers.get(tree_id, 0) + 1
        try:
            # Shielded: a registration cut off mid-way would leave a row that
            # this process does not know it has.
            await asyncio.shield(self._sync_watch(tree_id))
            yield
        finally:
            left = self._watchers[tree_id] - 1
            if left:
                self._watchers[tree_id] = left
            else:
                del self._watchers[tree_id]
                task = asyncio.create_task(self._sync_watch(tree_id))
                self._unwatching.add(task)
                task.add_done_callback(self._unwatching.discard)

    async def _sync_watch(self, tree_id: str) -> None:
        """Make the tree's watch row match whether a feed here follows it,
        retrying while the database is away (a failure to register would
        leave a followed tree silent)."""
        delay = 0.2
        while True:
            try:
                async with self._watch_lock:
                    wanted = tree_id in self._watchers
                    if self._pid is None or wanted == (tree_id in self._watched):
                        return  # not listening: the next connection registers it
                    async with self.pool.connection() as conn:
                        await self._set_watch(conn, wanted, tree_id, self._pid)
                    return
            except Exception as exc:
                if not is_connection_error(exc):
                    log.exception("the watch of tree %s failed", tree_id)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _set_watch(self, conn, wanted: bool, tree_id: str, pid: int) -> None:
        await db.execute(conn, "watch_events" if wanted else "unwatch_events",
                         {"tree_id": tree_id, "pid": pid})
        (self._watched.add if wanted else self._watched.discard)(tree_id)

    async def _opened(self, conn) -> None:
        """A new LISTEN connection, before it listens: its backend watches
        what this process follows; the previous one's watches (and those of
        backends gone) are dropped."""
        async with self._watch_lock:
            await db.execute(conn, "forget_watches", {"pid": self._last_pid})
            self._watched.clear()
            pid = conn.info.backend_pid
            for tree_id in list(self._watchers):
                await self._set_watch(conn, True, tree_id, pid)
            self._pid = self._last_pid = pid

    @contextlib.contextmanager
    def subscribe_turn(self, turn_id: str):
        """An Event set when the turn may have ended."""
        with _member(self._turn_subscribers, turn_id) as wake:
            yield wake

    @contextlib.contextmanager
    def subscribe_deltas(self, tree_id: str, wake: asyncio.Event):
        """A deque receiving the tree's `message.delta` payloads (dicts);
        `wake` is set when one arrives."""
        box = (collections.deque(maxlen=DELTA_BUFFER), wake)
        self._delta_subscribers[tree_id][id(box)] = box
        try:
            yield box[0]
        finally:
            members = self._delta_subscribers.get(tree_id)
            if members is not None:
                members.pop(id(box), None)
                if not members:
                    del self._delta_subscribers[tree_id]

    def _delta(self, payload: str) -> None:
        try:
            delta = msgspec.json.decode(payload)
            members = list(self._delta_subscribers.get(delta["tree_id"], {}).values())
        except (msgspec.DecodeError, KeyError, TypeError):
            return
        for queue, wake in members:
            queue.append(delta)
            wake.set()

    def _wake(self, tree_id: str) -> None:
        if TRACE:
            self.noted_at[tree_id] = time.monotonic()
        for wake in self._subscribers.get(tree_id, ()):
            wake.set()

    def _wake_all(self) -> None:
        for subscribers in (self._subscribers, self._turn_subscribers):
            for members in subscribers.values():
                for wake in members:
                    wake.set()

    def _note(self, note) -> None:
        if note.channel == DELTA_CHANNEL:
            self._delta(note.payload)
        elif note.channel == TURN_CHANNEL:
            for wake in self._turn_subscribers.get(note.payload, ()):
                wake.set()
        else:
            self._wake(note.payload.partition(" ")[0])

    def _connected(self, conn) -> None:
        self.connected = True
        self._wake_all()

    def _disconnected(self) -> None:
        self.connected = False
        self._pid = None

    async def _listen_forever(self) -> None:
        url = make_conninfo(self.url, application_name=LISTENER_NAME)
        await db.listen_forever(url, (CHANNEL, TURN_CHANNEL, DELTA_CHANNEL), self._note,
                                what="event listener", on_open=self._opened,
                                on_connect=self._connected,
                                on_disconnect=self._disconnected, poll_seconds=self.poll_seconds)


@contextlib.contextmanager
def _member(subscribers: dict[str, set[asyncio.Event]], key: str):
    """A new Event in `subscribers[key]` for the block."""
    wake = asyncio.Event()
    subscribers[key].add(wake)
    try:
        yield wake
    finally:
        members = subscribers.get(key)
        if members is not None:
            members.discard(wake)
            if not members:
                del subscribers[key]
