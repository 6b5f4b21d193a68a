"""SSE chunks written straight into uvicorn's transport (yuxi.api.direct),
against a real uvicorn server on loopback: the bytes on the wire are those
ASGI `send` would have written, and every case where only `send` may write
gets no writer."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvicorn
from litestar import asgi
from litestar.middleware import DefineMiddleware
from litestar.types import Receive, Scope, Send

from yuxi.api.direct import DirectWriter, YuxiApp, chunk, direct_writer
from yuxi.api.feed import KEEPALIVE, Feeds, Subscriber, TreeFeed, frame
from yuxi.settings import Settings

SSE_HEADERS = [(b"content-type", b"text/event-stream")]


def _app(seen: dict, headers=SSE_HEADERS, middleware=(), pause: bool = False) -> YuxiApp:
    @asgi("/stream", copy_scope=False)
    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        writer = seen["writer"] = direct_writer(scope)
        if writer is not None:
            if pause:  # the transport's buffer above its high-water mark
                writer._flow.pause_writing()
                seen["paused_write"] = writer.write(chunk(b"data: lost\n\n"))
                writer._flow.resume_writing()
            seen["wrote"] = writer.write(chunk(b"data: one\n\n"))
        if not seen.get("wrote"):
            await send({"type": "http.response.body", "body": b"data: one\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: two\n\n", "more_body": False})

    return YuxiApp(route_handlers=[stream], middleware=list(middleware))


async def _get(app, http: str = "httptools", method: str = "GET") -> tuple[bytes, bytes]:
    """(head, de-chunked body) of `method` /stream through a real uvicorn."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"{method} /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                     .encode())
        raw = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    finally:
        server.should_exit = True
        await serving
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return head, rest
    body = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        body, rest = body + rest[:n], rest[n + 2:]
    return head, body


async def test_a_chunk_written_into_the_transport_reads_as_one_sent_through_asgi():
    seen: dict = {}
    head, body = await _get(_app(seen))
    assert seen["writer"] is not None and seen["wrote"] is True
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"data: one\n\ndata: two\n\n"


async def test_a_paused_transport_takes_nothing_directly():
    # Negative case of the flow-control guard: while uvicorn's flow control
    # is paused the writer refuses, so the feed writes through `send`
    # (which waits for the drain) and nothing jumps the queue.
    seen: dict = {}
    _head, body = await _get(_app(seen, pause=True))
    assert seen["paused_write"] is False and seen["wrote"] is True
    assert body == b"data: one\n\ndata: two\n\n"


def _passthrough(app):
    async def middleware(scope, receive, send):
        await app(scope, receive, send)
    return middleware


# case: (app options, uvicorn's HTTP protocol, request method, the body read)
NOT_OURS = {
    # A middleware might change bodies: no server send in the scope.
    "middleware": ({"middleware": [DefineMiddleware(_passthrough)]}, "httptools", "GET", True),
    # Not chunked.
    "content-length": ({"headers": [*SSE_HEADERS, (b"content-length", b"22")]}, "httptools",
                       "GET", True),
    # h11 frames chunks itself.
    "h11": ({}, "h11", "GET", True),
    # A HEAD response has no body at all (uvicorn writes none).
    "head": ({}, "httptools", "HEAD", False),
}


@pytest.mark.parametrize("case", list(NOT_OURS))
async def test_only_send_may_write_where_a_body_is_not_ours_to_frame(case):
    options, http, method, has_body = NOT_OURS[case]
    seen: dict = {}
    _head, body = await _get(_app(seen, **options), http=http, method=method)
    assert seen["writer"] is None
    assert body == (b"data: one\n\ndata: two\n\n" if has_body else b"")


def test_the_server_send_is_kept_only_for_an_app_that_sends_bodies_unchanged():
    assert YuxiApp(route_handlers=[]).sends_bodies_unchanged
    assert not YuxiApp(route_handlers=[], before_send=[lambda m, s: None]).sends_bodies_unchanged


def test_the_api_sends_its_bodies_unchanged():
    # So its SSE streams take the direct path under uvicorn.
    from yuxi.api.app import create_app
    from yuxi.settings import Settings

    app = create_app(Settings(database_url="postgresql://127.0.0.1/yuxi_unused"))
    assert isinstance(app, YuxiApp) and app.sends_bodies_unchanged


class CountingWriter(DirectWriter):
    """The real writer, counting the chunks it wrote into the transport."""

    __slots__ = ("wrote",)

    def __init__(self, writer: DirectWriter) -> None:
        super().__init__(writer._cycle)
        self.wrote = 0

    def write(self, framed: bytes) -> bool:
        wrote = super().write(framed)
        self.wrote += wrote
        return wrote


def _row(seq: int) -> dict:
    return {"seq": seq, "type": "message", "session_id": "s", "turn_id": None,
            "run_id": None, "data": {"text": f"t{seq}"}, "created_at": "now"}


async def test_a_subscriber_writes_its_frames_and_keepalives_through_the_writer():
    # The feed's own path (yuxi.api.feed.Subscriber): a pass's frames, and a
    # body of its buffer (a keepalive), go into the transport; an empty body
    # and the last one go through `send`, which ends the response.
    feeds = Feeds(None, None, Settings(sse_keepalive_seconds=0.0))
    rows = [_row(1), _row(2)]
    seen: dict = {}

    @asgi("/stream", copy_scope=False)
    async def stream(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = seen["writer"] = CountingWriter(direct_writer(scope))
        sub = Subscriber(feeds, "t", None, 0, send, writer)
        sub.feed = TreeFeed(feeds, "t")
        sub.feed.high = 0
        sub.feed._append(rows)
        sub.offer({})
        sub.keepalive(float("inf"))
        # An empty body is no chunk: framed, it would be the response's end.
        sub._write({"type": "http.response.body", "body": b"", "more_body": True}, True)
        sub.end(b": bye\n\n")
        while not sub.closed:
            await asyncio.sleep(0.01)

    _head, body = await _get(YuxiApp(route_handlers=[stream]))
    assert seen["writer"].wrote == 2
    assert body == frame(rows[0]) + frame(rows[1]) + KEEPALIVE + b": bye\n\n"
