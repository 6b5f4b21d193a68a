"""SSE: `GET /api/sessions/{id}/events?scope=session|tree`.

`id:` is the per-tree sequence. `Last-Event-ID` (or `?after=`) resumes after
that sequence: events are read from the table, so a reconnect sees no gap and
no duplicate. Event numbers commit in order (the tree row lock), so a reader
at cursor N never misses an event that commits later with a smaller number.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from litestar import Request, get
from litestar.params import FromPath, HeaderParameter, QueryParameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from yuxi import db
from yuxi.api.auth import Caller
from yuxi.domain import Scope
from yuxi.errors import InvalidRequest
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


def _delta_frame(delta: dict) -> str:
    """`message.delta`: no `id:` line, not stored, not replayed."""
    return msgspec.json.encode({
        "type": "message.delta", "session_id": delta.get("session_id"),
        "turn_id": delta.get("turn_id"), "run_id": delta.get("run_id"),
        "data": {"message_id": delta.get("message_id"), "delta": delta.get("delta")},
    }).decode()


async def _fetch(pool, tree_id: str, session_id, after: int) -> list[dict]:
    async with pool.connection() as conn:
        return await db.fetch_all(
            conn, "events_after",
            {"tree_id": tree_id, "after": after, "session_id": session_id, "limit": BATCH})


async def _events(
    request: Request, tree_id: str, session_id: FromPath[uuid.UUID] | None, cursor: int
) -> AsyncIterator[ServerSentEventMessage]:
    state = request.app.state
    keepalive = state.settings.sse_keepalive_seconds
    only = str(session_id) if session_id is not None else None
    with state.hub.subscribe(tree_id) as wake, state.hub.subscribe_deltas(tree_id, wake) as deltas:
        yield ServerSentEventMessage(data=None, comment="connected", retry=1000)
        while True:
            wake.clear()  # before reading: a NOTIFY during the read wakes us again
            # Deltas first: they were sent before the durable events that follow.
            while deltas:
                delta = deltas.popleft()
                if only is None or delta.get("session_id") == only:
                    yield ServerSentEventMessage(data=_delta_frame(delta))
            # Shielded: a client disconnect must not cancel a query mid-flight
            # (psycopg would discard the pooled connection).
            rows = await asyncio.shield(_fetch(state.pool, tree_id, session_id, cursor))
            for row in rows:
                cursor = row["seq"]
                payload = {"seq": row["seq"], "type": row["type"],
                           "session_id": row["session_id"], "turn_id": row["turn_id"],
                           "run_id": row["run_id"], "data": row["data"],
                           "created_at": row["created_at"]}
                yield ServerSentEventMessage(
                    data=msgspec.json.encode(payload).decode(), id=row["seq"])
            if len(rows) == BATCH:
                continue
            try:
                await asyncio.wait_for(wake.wait(), timeout=keepalive)
            except TimeoutError:
                yield ServerSentEventMessage(data=None, comment="keepalive")
