"""Slow SSE consumers (issue 12): each subscriber has a bounded buffer; one
that falls too far behind is closed with a final comment telling it to
resume from its last id, and resuming from there is gap-free. Memory stays
bounded with many idle subscribers (the 1,000-subscriber figure is measured
by benchmarks/sse_memory.py and written in benchmarks/README.md)."""

from __future__ import annotations

import asyncio
import re

import psutil
import pytest

from tests.e2e.helpers import client, open_stream, session_with_script

pytestmark = pytest.mark.e2e

BIG = "x" * 50_000


def _write_events(pg, tree: str, session: str, n: int) -> None:
    for _ in range(n):
        pg.scalar("SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.big', "
                  "jsonb_build_object('blob', %s::text))", (tree, session, BIG))


async def test_a_slow_consumer_is_closed_with_its_resume_id(start_api, alice, pg):
    key, _ = alice
    api = start_api(YUXI_SSE_BUFFER_EVENTS="4", YUXI_SSE_SLOW_CONSUMER_SECONDS="1")
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "ok"}]})
        sid, tree = session["id"], session["tree_id"]
        async with open_stream(c, sid, scope="tree") as stream:
            await stream.read_until(lambda s: len(s.events) >= 1)
            # ~20 MB while the client reads nothing: socket buffers and the
            # subscriber's 4-event buffer fill up.
            await asyncio.to_thread(_write_events, pg, tree, sid, 400)
            await asyncio.sleep(3)
            await stream.read_until_closed(timeout=30)
        last = [c_ for c_ in stream.comments if c_.startswith("too far behind")]
        assert last, stream.comments[-5:]
        resume = int(re.search(r"Last-Event-ID: (\d+)", last[-1]).group(1))
        assert resume == stream.seqs[-1] < 401, (resume, stream.seqs[-3:])
        assert stream.seqs == list(range(1, resume + 1))
        # Resuming from there gets the rest, gap-free.
        async with open_stream(c, sid, scope="tree", last_event_id=resume) as again:
            await again.read_until(lambda s: s.seqs and s.seqs[-1] == 401, timeout=30)
        assert again.seqs == list(range(resume + 1, 402))


async def test_memory_stays_bounded_with_idle_subscribers(start_api, alice):
    """200 idle subscribers on one API process cost well under 100 KB each
    (the request task, its buffer, the connection); 1,000 are measured by
    benchmarks/sse_memory.py."""
    key, _ = alice
    api = start_api()
    proc = psutil.Process(start_api.procs[-1].popen.pid)
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "ok"}]})
        before = proc.memory_info().rss
        import httpx
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(base_url=api, limits=limits, timeout=30,
                                     headers={"Authorization": f"Bearer {key}"}) as many:
            streams = []
            for _ in range(200):
                cm = many.stream("GET", f"/api/sessions/{session['id']}/events")
                streams.append((cm, await cm.__aenter__()))
            assert all(r.status_code == 200 for _, r in streams)
            await asyncio.sleep(1)
            during = proc.memory_info().rss
            for cm, _ in streams:
                await cm.__aexit__(None, None, None)
    per_subscriber = (during - before) / 200
    assert per_subscriber < 100_000, per_subscriber


async def _reset_mid_stream(api: str, key: str, sid: str) -> None:
    """A raw client that opens the tree's stream, reads a little and goes away
    with a TCP reset (SO_LINGER 0) while frames are flowing to it."""
    import socket
    import struct
    from urllib.parse import urlsplit

    url = urlsplit(api)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write((f"GET /api/sessions/{sid}/events?scope=tree HTTP/1.1\r\n"
                  f"Host: {url.netloc}\r\nAuthorization: Bearer {key}\r\n\r\n").encode())
    await reader.readexactly(200_000)  # mid-stream: the big events are arriving
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def test_a_stalled_or_vanished_subscriber_does_not_hold_up_the_others(
        start_api, alice, pg):
    """The tree's feed writes to every subscriber itself (yuxi.api.feed): a
    client that stops reading (its socket full, its send waiting) and one
    that resets its connection mid-stream must not delay the others. The
    stalled one, not yet a slow consumer, gets everything gap-free once it
    reads again."""
    key, _ = alice
    api = start_api(YUXI_SSE_BUFFER_EVENTS="4", YUXI_SSE_SLOW_CONSUMER_SECONDS="60")
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "ok"}]})
        sid, tree = session["id"], session["tree_id"]
        async with open_stream(c, sid, scope="tree") as stalled, \
                open_stream(c, sid, scope="tree") as reader:
            await stalled.read_until(lambda s: len(s.events) >= 1)
            await reader.read_until(lambda s: len(s.events) >= 1)
            # ~15 MB: more than the stalled client's socket buffers hold.
            writing = asyncio.create_task(asyncio.to_thread(_write_events, pg, tree, sid, 300))
            await reader.read_until(lambda s: len(s.events) >= 5)
            await _reset_mid_stream(api, key, sid)
            await writing
            # Well before the stalled one could be closed as a slow consumer.
            await reader.read_until(lambda s: s.seqs[-1] == 301, timeout=20)
            assert reader.seqs == list(range(1, 302))
            assert not stalled.comments or not any(
                m.startswith("too far behind") for m in stalled.comments)
            await stalled.read_until(lambda s: s.seqs[-1] == 301, timeout=30)
            assert stalled.seqs == list(range(1, 302))


async def test_a_batch_larger_than_the_buffer_arrives_whole(start_api, alice, pg):
    """20 events in one transaction (one NOTIFY, one feed read) to a
    subscriber with a 4-frame buffer: frames written at once free their room,
    so the rest follows without another notification."""
    key, _ = alice
    api = start_api(YUXI_SSE_BUFFER_EVENTS="4")
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "ok"}]})
        sid, tree = session["id"], session["tree_id"]
        async with open_stream(c, sid) as stream:
            await stream.read_until(lambda s: len(s.events) >= 1)
            pg.scalar("SELECT count(yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.small', "
                      "jsonb_build_object('n', n))) FROM generate_series(1, 20) AS n",
                      (tree, sid))
            await stream.read_until(lambda s: s.seqs[-1] == 21, timeout=5)
        assert stream.seqs == list(range(1, 22))
