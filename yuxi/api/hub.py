"""One LISTEN connection per API process, fanned out to SSE subscribers
and to requests waiting for a turn's end.

`yuxi_events` payloads carry the tree id only (one per transaction); a
woken tree feed (yuxi.api.feed) re-reads the events table after its
high-water mark, so a lost or collapsed notification costs latency, never an
event. `yuxi_turns` payloads are the ids of turns that ended (completed,
failed, cancelled); a woken waiter reads its turn. After a (re)connect every
subscriber is woken, since notifications sent while disconnected are gone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections import defaultdict

import msgspec
from psycopg.conninfo import make_conninfo

from yuxi import db

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
    def __init__(self, url: str, *, poll_seconds: float = 5.0) -> None:
        self.url = url
        self.poll_seconds = poll_seconds
        self.connected = False
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
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def subscribe(self, tree_id: str):
        """An Event set whenever the tree may have new events."""
        with _member(self._subscribers, tree_id) as wake:
            yield wake

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

    async def _listen_forever(self) -> None:
        url = make_conninfo(self.url, application_name=LISTENER_NAME)
        await db.listen_forever(url, (CHANNEL, TURN_CHANNEL, DELTA_CHANNEL), self._note,
                                what="event listener", on_connect=self._connected,
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
