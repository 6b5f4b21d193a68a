"""Server-Sent Events against the real API processes: resuming with
Last-Event-ID or ?after= loses and repeats nothing, every API process sees
every event of a tree, idle streams keep alive, and scope is enforced."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.helpers import (
    EventStream, client, has_event, ok, open_stream, post_input, session_with_script,
    strip_event, wait_for,
)

pytestmark = pytest.mark.e2e

SCRIPT = {
    "default": [
        {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}], "delay_ms": 200},
        {"say": "got {{ last.text }}", "delay_ms": 400},
    ],
}


def keepalives(n: int):
    def check(stream: EventStream) -> bool:
        return stream.comments.count("keepalive") >= n
    return check


def another_keepalive(stream: EventStream):
    """A condition: one more keepalive than `stream` has read so far (so the
    server was idle after everything read until now)."""
    return keepalives(stream.comments.count("keepalive") + 1)


def reached(seq: int):
    def check(stream: EventStream) -> bool:
        return bool(stream.events) and stream.events[-1]["seq"] >= seq
    return check


async def test_resume_keepalive_and_scope(worker, api, alice, mallory, pg):
    """(a), (b), (d), (e) on one API and one worker: process start-up dominates."""
    await resume_with_last_event_id_and_after(api, alice, pg)
    await keepalive_and_scope(api, alice, mallory, pg)


async def resume_with_last_event_id_and_after(api, alice, pg):
    key, _ = alice
    async with client(api, key) as c:
        session = await session_with_script(c, SCRIPT, tools=["echo"], name="resume")
        sid, tree = session["id"], session["tree_id"]

        # (a) Read until the run started, disconnect mid-turn, reconnect with
        # Last-Event-ID while the turn goes on.
        async with open_stream(c, sid) as first:
            receipt = await post_input(c, sid, "resume me", mode="queue")
            turn_id = receipt["turn_id"]
            await first.read_until(has_event("run.started", turn_id=turn_id))
        cut = first.events[-1]["seq"]
        async with open_stream(c, sid, last_event_id=cut) as second:
            await second.read_until(has_event("turn.completed", turn_id=turn_id))
            # Nothing more comes (no replay of what was already sent).
            await second.read_until(another_keepalive(second), timeout=5)
        assert second.seqs[0] == cut + 1

        db_events = pg.events(tree, sid)
        union = first.events + second.events
        assert [e["seq"] for e in union] == [e["seq"] for e in db_events]
        assert [strip_event(e) for e in union] == db_events
        assert [e["type"] for e in db_events] == [
            "session.created", "input.received", "turn.started", "run.started", "message",
            "tool.started", "tool.finished", "message", "run.completed", "turn.completed"]

        # A reconnect after the end replays from the table only what follows.
        last = db_events[-1]["seq"]
        async with open_stream(c, sid, last_event_id=last - 3) as tail:
            await tail.read_until(reached(last))
        assert [strip_event(e) for e in tail.events] == db_events[-3:]

        # (b) ?after= behaves the same, from any point.
        for after in (0, 1, cut, last - 1):
            async with open_stream(c, sid, after=after) as stream:
                await stream.read_until(reached(last))
            assert [strip_event(e) for e in stream.events] == db_events[after:], after
        # At the end: no event, only keepalives.
        async with open_stream(c, sid, after=last) as stream:
            await stream.read_until(keepalives(1), timeout=5)
        assert stream.events == []

        # A cursor that is not a sequence number is refused.
        bad = await c.get(f"/api/sessions/{sid}/events", headers={"Last-Event-ID": "abc"})
        assert bad.status_code == 422, bad.text


async def keepalive_and_scope(api, alice, mallory, pg):
    """Idle streams get keepalive comments; another user's session is 404
    and another user's events never reach a stream."""
    key, _ = alice
    mkey, _ = mallory
    script = {"default": [{"say": "hi"}]}
    async with client(api, key) as c, client(api, mkey) as m:
        session = await session_with_script(c, script, name="idle")
        sid = session["id"]
        own = await session_with_script(m, script, name="mallory-agent")

        # (e) The stream of alice's session does not exist for mallory.
        async with m.stream("GET", f"/api/sessions/{sid}/events",
                            params={"scope": "tree"}) as response:
            await response.aread()
        assert response.status_code == 404, response.text
        assert response.json()["code"] == "not_found"

        # (d) Idle: "connected", then a keepalive about every second.
        async with open_stream(c, sid) as idle:
            started = time.monotonic()
            await idle.read_until(keepalives(2), timeout=6)
            elapsed = time.monotonic() - started
        assert idle.comments[0] == "connected"
        assert [e["type"] for e in idle.events] == ["session.created"]
        assert 0.9 <= elapsed < 6, elapsed

        # Alice's new work (input received, turn started) never reaches
        # mallory's stream, which only ever sees her own tree.
        async with open_stream(m, own["id"], scope="tree") as spy:
            await spy.read_until(has_event("session.created"))
            receipt = await post_input(c, sid, "private", mode="queue")
            await spy.read_until(another_keepalive(spy), timeout=6)
        assert [(e["type"], e["session_id"]) for e in spy.events] == [
            ("session.created", own["id"])]
        assert pg.scalar("SELECT count(*) FROM yuxi.events WHERE turn_id = %s",
                         (receipt["turn_id"],)) >= 2


async def test_two_api_processes_see_every_event(start_api, worker, alice, pg):
    """Each API process has its own LISTEN connection: both fan every event
    of the tree out to their subscribers, in order."""
    key, _ = alice
    api1, api2 = start_api.many(2)
    script = {"default": [{"say": "answer to {{ input }}", "delay_ms": 50}]}
    async with client(api1, key) as c1, client(api2, key) as c2:
        session = await session_with_script(c1, script)
        sid, tree = session["id"], session["tree_id"]
        async with open_stream(c1, sid, scope="tree") as s1, \
                open_stream(c2, sid, scope="tree") as s2:
            # Both streams are live before any work is posted.
            await asyncio.gather(s1.read_until(has_event("session.created")),
                                 s2.read_until(has_event("session.created")))
            receipts = []
            for i in range(4):
                receipts.append(await post_input((c1, c2)[i % 2], sid, f"q{i}", mode="queue"))
            await asyncio.gather(
                s1.read_until(has_event("turn.completed", count=4), timeout=30),
                s2.read_until(has_event("turn.completed", count=4), timeout=30))

        db_events = pg.events(tree)
        assert [e["seq"] for e in db_events] == list(range(1, len(db_events) + 1))
        assert db_events[-1]["type"] == "turn.completed"
        for stream in (s1, s2):
            assert [strip_event(e) for e in stream.events] == db_events
        turn_ids = [r["turn_id"] for r in receipts]
        completed = [e["turn_id"] for e in s1.events if e["type"] == "turn.completed"]
        assert completed == turn_ids
        for i, r in enumerate(receipts):
            result = ok(await c2.get(f"/api/turns/{r['turn_id']}/result"))
            assert result["output"]["text"] == f"answer to q{i}"


async def test_sigterm_ends_open_streams(start_api, alice):
    """A graceful stop of an API process ends its SSE streams (clients then
    resume with Last-Event-ID on another process) and the process exits."""
    key, _ = alice
    api = start_api()
    proc = start_api.procs[-1]
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "hi"}]})
        async with open_stream(c, session["id"]) as stream:
            await stream.read_until(has_event("session.created"))
            proc.terminate()
            await stream.read_until_closed(timeout=3)

    async def exited():
        return proc.popen.poll() is not None
    await wait_for(exited, 5, "the API process to exit after SIGTERM")


async def test_reconnect_of_an_after_stream_resumes_from_last_event_id(api, alice):
    """EventSource reconnects to the URL it was opened with, adding the
    Last-Event-ID header: the header, the newer cursor, must win."""
    key, _ = alice
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "hi"}]})
        sid = session["id"]
        await post_input(c, sid, "no worker: the turn waits", mode="queue")
        async with open_stream(c, sid, after=0) as first:
            await first.read_until(has_event("turn.started"))
        last = first.seqs[-1]
        assert first.seqs == list(range(1, last + 1))
        # The browser's reconnect: same URL, plus the last id it saw.
        async with open_stream(c, sid, after=0, last_event_id=last) as again:
            await again.read_until(keepalives(1), timeout=5)
        assert again.seqs == [], f"replayed again: {again.seqs}"


async def test_bad_scope_error_names_the_query_parameter(api, alice):
    key, _ = alice
    async with client(api, key) as c:
        session = await session_with_script(c, {"default": [{"say": "hi"}]})
        response = await c.get(f"/api/sessions/{session['id']}/events",
                               params={"scope": "everything"})
        assert response.status_code == 422, response.text
        assert [e["field"] for e in response.json()["errors"]] == ["scope"], response.text
