"""SSE frames written straight into uvicorn's transport (issue 15).

A delivery pass hands the same body to every subscriber of a tree. Through
ASGI, each of those 500 writes costs two coroutines (Litestar's wrapper,
uvicorn's `send`), their checks and their own chunk framing; measured, that
was about as much as the socket write itself, and a pass took ~8 ms where a
bare loop writing to the same sockets takes ~3.5. So the feed frames a
pass's body once (HTTP/1.1 chunked, byte for byte as uvicorn frames it) and
writes it into each connection's transport, doing just what uvicorn's
`send` does for a body chunk: nothing while the transport's buffer is above
its high-water mark (then the write goes through `send`, which waits for the
drain, and the subscriber's frames collect in its bounded buffer), nothing
once the client is gone.

Only for uvicorn's httptools protocol (the one `yuxi serve` runs; h11
frames chunks itself), after the response has started with chunked
encoding, and only when no middleware or `before_send` hook could change a
body on its way (create_app adds none). Anything else (Litestar's test
client, another server) writes through ASGI `send`, as before.
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar

# The server's own ASGI `send`, kept in the scope by YuxiApp (Litestar hands
# the route a wrapped one).
RAW_SEND = "yuxi.raw_send"
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"
# What the writer reads of uvicorn's RequestResponseCycle (private: a uvicorn
# without one of them gets no writer, and tests/unit/test_sse_direct.py fails).
_CYCLE_ATTRS = ("flow", "transport", "disconnected", "response_complete")


class YuxiApp(Litestar):
    """The Litestar app, which keeps the server's `send` in each HTTP scope
    when bodies go out unchanged (no middleware, hook or compression)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.sends_bodies_unchanged:
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)

    @property
    def sends_bodies_unchanged(self) -> bool:
        return not (self.middleware or self.before_send or self.compression_config)


def chunk(body: bytes) -> bytes:
    """`body` as one HTTP/1.1 chunk (uvicorn's framing: size, CRLF, body, CRLF)."""
    return b"%x\r\n%b\r\n" % (len(body), body)


class DirectWriter:
    """Writes chunks into one uvicorn connection while its transport takes
    them without waiting; `write` says False when the chunk must go
    through ASGI `send` instead."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle, self._flow, self._transport = cycle, cycle.flow, cycle.transport

    def write(self, framed: bytes) -> bool:
        cycle = self._cycle
        if self._flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        self._transport.write(framed)
        return True


def direct_writer(scope: Any) -> DirectWriter | None:
    """A writer for the connection of `scope`'s started, chunked response, or
    None where only ASGI `send` may write."""
    cycle = getattr(scope.get(RAW_SEND), "__self__", None)
    if (type(cycle).__module__ != _HTTPTOOLS or not getattr(cycle, "response_started", False)
            or getattr(cycle, "chunked_encoding", None) is not True
            or not all(hasattr(cycle, a) for a in _CYCLE_ATTRS)
            or not hasattr(cycle.flow, "write_paused")):
        return None
    return DirectWriter(cycle)
