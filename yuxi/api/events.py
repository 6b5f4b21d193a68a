"""SSE: `GET /api/sessions/{id}/events?scope=session|tree`.

`id:` is the per-tree sequence. `Last-Event-ID` (or `?after=`) resumes after
that sequence: events are read from the table, so a reconnect sees no gap and
no duplicate. Event numbers commit in order (the tree row lock), so a reader
at cursor N never misses an event that commits later with a smaller number.

Delivery is yuxi.api.feed's: one reader of the table per tree and process
writes each subscriber's frames straight into its connection (no task per
subscriber on the hot path), with a bounded buffer per subscriber
(YUXI_SSE_BUFFER_EVENTS frames). A client that cannot take new events for
YUXI_SSE_SLOW_CONSUMER_SECONDS is sent
`: too far behind: reconnect with Last-Event-ID: <n>` and closed; a database
outage only pauses delivery. Token deltas of streaming models
(`message.delta`, no `id:`) come from the hub's delta channel and are never
read from the table.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Request, get
from litestar.params import FromPath, HeaderParameter, QueryParameter
from litestar.response import ServerSentEvent

from yuxi.api.auth import Caller
from yuxi.api.direct import direct_writer
from yuxi.api.feed import CONNECTED, Subscriber
from yuxi.errors import InvalidRequest
from yuxi.services import sessions


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
    return EventStream(str(session.tree_id), str(only) if only is not None else None, cursor)


class EventStream(ServerSentEvent):
    """The stream's response: Litestar sends its status and headers, then
    the subscriber is attached to its tree's feed (yuxi.api.feed), which
    writes frames into the connection's ASGI `send` itself. The request's
    own task only waits for the client to go away (or the stream to end)."""

    def __init__(self, tree_id: str, session_id: str | None, cursor: int) -> None:
        super().__init__(content=())
        self.stream = (tree_id, session_id, cursor)

    def to_asgi_response(self, app, request: Request, **kwargs):
        response = super().to_asgi_response(app, request, **kwargs)
        tree_id, session_id, cursor = self.stream
        feeds = request.app.state.feeds

        async def asgi(scope, receive, send) -> None:
            await response.start_response(send)
            await send({"type": "http.response.body", "body": CONNECTED, "more_body": True})
            sub = Subscriber(feeds, tree_id, session_id, cursor, send, direct_writer(scope))
            with feeds.subscribe(sub):
                # uvicorn answers http.disconnect when the client goes and
                # when the stream's last body has gone out (Subscriber.end).
                while (await receive())["type"] != "http.disconnect":
                    pass

        return asgi
