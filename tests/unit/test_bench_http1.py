"""The benches' lean HTTP/1.1 client (benchmarks/http1.py) against a
loopback server that answers as scripted: a response, an event stream, or
nothing (its timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from benchmarks.http1 import Http1Client


@contextlib.asynccontextmanager
async def server(reply: bytes | None):
    """A loopback server that reads one request head and writes `reply`
    (None: writes nothing and keeps the connection open)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is not None:
            writer.write(reply)
            await writer.drain()
        with contextlib.suppress(Exception):
            await reader.read()  # until the client closes
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()


async def within(coro, seconds: float = 5.0) -> BaseException | None:
    """What `coro` raised (None: it returned), failing the test when it
    is still running after `seconds` (a client without its timeout)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        pytest.fail(f"still waiting after {seconds} s")
    return task.exception()


async def test_a_response_is_read():
    body = json.dumps({"ok": True}).encode()
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with server(reply) as base:
        client = Http1Client(base, {}, timeout=5)
        assert await client.get_json("/x") == (200, {"ok": True})
        await client.aclose()


async def test_a_server_that_never_answers_times_out():
    async with server(None) as base:
        client = Http1Client(base, {}, timeout=0.2)
        raised = await within(client.post_json("/x", {}))
        assert isinstance(raised, TimeoutError)
        assert str(raised) == "POST /x: no response in 0.2 s"
        assert client._writer is None  # closed: a late answer cannot reach the next request


async def test_an_event_stream_yields_its_data_lines_across_chunks():
    events = b"id: 1\ndata: {\"seq\": 1}\n\ndata: {\"seq\""  # the second split over chunks
    rest = b": 2}\n\n"
    reply = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
             + b"%x\r\n%s\r\n" % (len(events), events)
             + b"%x\r\n%s\r\n" % (len(rest), rest) + b"0\r\n\r\n")
    async with server(reply) as base:
        client = Http1Client(base, {}, timeout=5)
        async with contextlib.aclosing(client.sse_events("/events")) as stream:
            assert [e async for e in stream] == [{"seq": 1}, {"seq": 2}]


async def test_an_event_stream_that_goes_silent_times_out():
    reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n: hi\n\r\n"
    async with server(reply) as base:
        client = Http1Client(base, {}, timeout=0.2)

        async def read_all() -> None:
            async with contextlib.aclosing(client.sse_events("/events")) as stream:
                async for _ in stream:
                    pass

        assert isinstance(await within(read_all()), TimeoutError)
