"""SSE: `GET /api/sessions/{id}/events?scope=session|tree`.

`id:` is the per-tree sequence. `Last-Event-ID` (or `?after=`) resumes after
that sequence: events are read from the table, so a reconnect sees no gap and
no duplicate. Event numbers commit in order (the tree row lock), so a reader
at cursor N never misses an event that commits later with a smaller number.

Each subscriber is a reader task (table -> bounded buffer of
YUXI_SSE_BUFFER_EVENTS frames) and the response's sender (buffer -> client).
A client whose buffer stays full for YUXI_SSE_SLOW_CONSUMER_SECONDS is sent
`: too far behind: reconnect with Last-Event-ID: <n>` and closed; a database
outage only pauses the reader. Token deltas of streaming models
(`message.delta`, no `id:`) come from the hub's delta channel and are never
read from the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from litestar import Request, get
from litestar.params import FromPath, HeaderParameter, QueryParameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from yuxi.api.feed import fetch as _fetch
from yuxi.api.auth import Caller
from yuxi.errors import InvalidRequest, is_connection_error
from yuxi.services import sessions

BATCH = 500


def _cursor(after: int | None, last_event_id: str | None) -> int:
    """Last-Event-ID wins over ?after=: an EventSource reconnects to the URL
    it was opened with and adds the header, which is the newer cursor."""
    if last_event_id:
        try:
            return int(last_event_id)
        except ValueError:
            raise InvalidRequest(
                "Last-Event-ID must be an event sequence number",
                errors=[{"field": "Last-Event-ID", "message": "not a sequence number"}],
            ) from None
    return after or 0


@get("/api/sessions/{session_id:uuid}/events", operation_id="streamEvents", tags=["events"])
async def stream_events(
    request: Request,
    caller: Caller,
    session_id: FromPath[uuid.UUID],
    scope_: Annotated[str, QueryParameter(name="scope")] = "session",
    after: Annotated[int | None, QueryParameter(ge=0)] = None,
    last_event_id: Annotated[str | None, HeaderParameter(name="last-event-id")] = None,
) -> ServerSentEvent:
    if scope_ not in ("session", "tree"):
        raise InvalidRequest("scope must be session or tree",
                             errors=[{"field": "scope", "message": "must be session or tree"}])
    session = await sessions.get_session(request.app.state.pool, caller, session_id)
    cursor = _cursor(after, last_event_id)
    only = None if scope_ == "tree" else session_id
    return ServerSentEvent(_events(request, str(session.tree_id), only, cursor))


def _delta_frame(delta: dict) -> bytes:
    """`message.delta`: no `id:` line, not stored, not replayed."""
    return ServerSentEventMessage(data=msgspec.json.encode({
        "type": "message.delta", "session_id": delta.get("session_id"),
        "turn_id": delta.get("turn_id"), "run_id": delta.get("run_id"),
        "data": {"message_id": delta.get("message_id"), "delta": delta.get("delta")},
    }).decode()).encode()


def _frame(row: dict) -> bytes:
    """An event's SSE frame, encoded once: a row of the feed's window is
    shared by all of the tree's subscribers, and so is its frame."""
    frame = row.get("_sse")
    if frame is None:
        payload = {"seq": row["seq"], "type": row["type"], "session_id": row["session_id"],
                   "turn_id": row["turn_id"], "run_id": row["run_id"], "data": row["data"],
                   "created_at": row["created_at"]}
        frame = row["_sse"] = ServerSentEventMessage(
            data=msgspec.json.encode(payload).decode(), id=row["seq"]).encode()
    return frame


class _Encoded(ServerSentEventMessage):
    """Frames encoded already, sent in one write (Litestar writes what
    `encode` returns)."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(data=None)
        self.raw = raw

    def encode(self) -> bytes:
        return self.raw


# What the reader hands the sender besides frames.
_KEEPALIVE = object()
KEEPALIVE = ServerSentEventMessage(data=None, comment="keepalive").encode()
# Frames one write carries at most.
SEND_BATCH = 256


class _TooSlow:
    def __init__(self, last_id: int) -> None:
        self.last_id = last_id


async def _read(state, tree_id: str, session_id, cursor: int, buffer: asyncio.Queue) -> None:
    """The reader of one subscriber: whenever the tree's feed (yuxi.api.feed)
    has read new events, it takes those after `cursor` from the feed's window
    into the subscriber's bounded `buffer`; behind the window (a replay), it
    reads the table itself until it reaches it. The database away is no
    error: the hub wakes every feed when its LISTEN connection is back, and
    reading goes on from the cursor, so the events written meanwhile arrive
    gap-free and once."""
    settings = state.settings
    batch = max(1, min(BATCH, settings.sse_buffer_events))
    only = str(session_id) if session_id is not None else None
    mine = asyncio.Event()
    with state.feeds.subscribe(tree_id, mine) as (feed, wake), \
            state.hub.subscribe_deltas(tree_id, wake) as deltas:
        while True:
            wake.clear()  # before reading: a NOTIFY during the read wakes us again
            # Deltas first: they were sent before the durable events that
            # follow. Ephemeral: a full buffer drops them rather than wait.
            while deltas:
                delta = deltas.popleft()
                if only is None or delta.get("session_id") == only:
                    with contextlib.suppress(asyncio.QueueFull):
                        buffer.put_nowait(_delta_frame(delta))
            rows = feed.after(cursor) if feed is not None else None
            from_table = rows is None
            if from_table:
                try:
                    # Shielded: a client disconnect must not cancel a query
                    # mid-flight (psycopg would discard the pooled connection).
                    # With a feed, catching up reads the whole tree (filtered
                    # here) so the cursor reaches the feed's window.
                    rows = await asyncio.shield(_fetch(
                        state.pool, tree_id, session_id if feed is None else None, cursor,
                        batch))
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                    rows = None  # read again when woken (or at the next keepalive)
            for row in rows or ():
                if only is None or str(row["session_id"]) == only:
                    try:
                        try:
                            buffer.put_nowait(_frame(row))  # the common case: room
                        except asyncio.QueueFull:
                            await asyncio.wait_for(buffer.put(_frame(row)),
                                                   settings.sse_slow_consumer_seconds)
                    except TimeoutError:
                        # The buffer stayed full: the client reads slower than
                        # its tree writes. It resumes from the last id it got.
                        await buffer.put(_TooSlow(cursor))
                        return
                cursor = row["seq"]
            if from_table and rows and (len(rows) == batch or feed is not None):
                continue  # more to read, or now see whether the window reaches
            try:
                await asyncio.wait_for(wake.wait(), timeout=settings.sse_keepalive_seconds)
            except TimeoutError:
                if buffer.empty():
                    buffer.put_nowait(_KEEPALIVE)


async def _events(
    request: Request, tree_id: str, session_id: FromPath[uuid.UUID] | None, cursor: int
) -> AsyncIterator[ServerSentEventMessage]:
    """The sender: frames from the subscriber's bounded buffer, in order."""
    state = request.app.state
    buffer: asyncio.Queue = asyncio.Queue(maxsize=max(1, state.settings.sse_buffer_events))
    reader = asyncio.create_task(_read(state, tree_id, session_id, cursor, buffer),
                                 name=f"sse-reader-{tree_id}")
    get: asyncio.Future | None = None
    try:
        yield ServerSentEventMessage(data=None, comment="connected", retry=1000)
        while True:
            if reader.done() and buffer.empty():
                reader.result()  # raises the reader's error, if it failed
                return
            get = asyncio.ensure_future(buffer.get())
            done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done and reader.exception() is not None:
                get.cancel()
                raise reader.exception()  # type: ignore[misc]
            item = await get
            # Everything already buffered goes out in one write: per-frame
            # sends cost more than the frames (500 subscribers x a turn's
            # events).
            chunks: list[bytes] = []
            while True:
                if item is _KEEPALIVE:
                    chunks.append(KEEPALIVE)
                elif isinstance(item, _TooSlow):
                    chunks.append(ServerSentEventMessage(
                        data=None, comment=f"too far behind: reconnect with Last-Event-ID: "
                                           f"{item.last_id}").encode())
                    yield _Encoded(b"".join(chunks))
                    return
                else:
                    chunks.append(item)
                if len(chunks) >= SEND_BATCH or buffer.empty():
                    break
                item = buffer.get_nowait()
            yield _Encoded(b"".join(chunks))
    finally:
        reader.cancel()
        if get is not None:
            get.cancel()
