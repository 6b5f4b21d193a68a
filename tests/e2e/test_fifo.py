"""Queued inputs of one session run one at a time, in the order received,
each answering its own input; a replayed client_request_id is one input."""

from __future__ import annotations

import asyncio
import datetime as dt

import httpx
import pytest

from tests.e2e.helpers import (
    Db, client, has_event, ok, open_stream, post_input, result_of, session_with_script,
    wait_turn_done,
)

pytestmark = pytest.mark.e2e

SCRIPT = {
    "rules": [{"match": "^slow", "steps": [{"say": "done: {{ input }}", "delay_ms": 300}]}],
    "default": [{"say": "done: {{ input }}"}],
}


def ts(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value)


async def test_fifo_and_idempotent_receipts(worker, api, alice, pg):
    # One API and one worker for both parts: process start-up dominates.
    key, _ = alice
    async with client(api, key) as c:
        await queued_inputs_complete_in_order(c, pg)
        await client_request_id_replay_is_one_input(c, pg)


async def queued_inputs_complete_in_order(c: httpx.AsyncClient, pg: Db) -> None:
    contents = ["slow first", "second", "third"]
    sid = (await session_with_script(c, SCRIPT, name="fifo"))["id"]
    async with open_stream(c, sid) as stream:
        receipts = [await post_input(c, sid, text, mode="queue") for text in contents]
        turn_ids = [r["turn_id"] for r in receipts]
        await stream.read_until(has_event("turn.completed", count=3), timeout=30)

    # The first starts at once; the others wait their turn in the FIFO.
    assert receipts[0]["status"] == "started" and receipts[0]["position"] is None
    assert [(r["status"], r["position"]) for r in receipts[1:]] == [("queued", 1),
                                                                    ("queued", 2)]
    assert all(r["mode"] == "queue" for r in receipts)
    assert len(set(turn_ids)) == 3

    completed = [e["turn_id"] for e in stream.events if e["type"] == "turn.completed"]
    started = [e["turn_id"] for e in stream.events if e["type"] == "turn.started"]
    assert completed == turn_ids and started == turn_ids
    # One turn at a time: each turn starts only after the previous completed.
    order = [(e["type"], e["turn_id"]) for e in stream.events
             if e["type"] in ("turn.started", "turn.completed")]
    assert order == [(kind, t) for t in turn_ids
                     for kind in ("turn.started", "turn.completed")]

    turns = ok(await c.get(f"/api/sessions/{sid}/turns"))
    assert [t["id"] for t in turns] == turn_ids
    assert all(t["status"] == "completed" for t in turns)
    for prev, nxt in zip(turns, turns[1:]):
        assert ts(prev["finished_at"]) < ts(nxt["finished_at"])
        assert ts(prev["finished_at"]) <= ts(nxt["started_at"])

    for turn_id, text in zip(turn_ids, contents):
        result = await result_of(c, turn_id)
        assert result["status"] == "completed"
        assert result["output"]["text"] == f"done: {text}"

    db_order = pg.rows("SELECT id::text FROM yuxi.turns WHERE session_id = %s "
                       "ORDER BY finished_at", (sid,))
    assert [r["id"] for r in db_order] == turn_ids
    assert pg.scalar("SELECT count(*) FROM yuxi.inputs WHERE session_id = %s "
                     "AND status = 'completed'", (sid,)) == 3


async def client_request_id_replay_is_one_input(c: httpx.AsyncClient, pg: Db) -> None:
    sid = (await session_with_script(c, SCRIPT, name="replayed-requests"))["id"]
    first = await post_input(c, sid, "only once", mode="queue", client_request_id="req-1")
    received = ("SELECT count(*) FROM yuxi.events "
                "WHERE session_id = %s AND type = 'input.received'")
    events_after_first = pg.scalar(received, (sid,))
    again = await post_input(c, sid, "only once", mode="queue", client_request_id="req-1")
    assert (again["input_id"], again["turn_id"]) == (first["input_id"], first["turn_id"])

    # Concurrent replays of another key: one input, every receipt names it.
    racing = await asyncio.gather(*[
        post_input(c, sid, "raced", mode="queue", client_request_id="req-2")
        for _ in range(5)])
    assert len({r["input_id"] for r in racing}) == 1
    assert len({r["turn_id"] for r in racing}) == 1

    assert pg.scalar("SELECT count(*) FROM yuxi.inputs WHERE session_id = %s "
                     "AND client_request_id = 'req-1'", (sid,)) == 1
    assert pg.scalar("SELECT count(*) FROM yuxi.inputs WHERE session_id = %s "
                     "AND client_request_id = 'req-2'", (sid,)) == 1
    assert pg.scalar("SELECT count(*) FROM yuxi.inputs WHERE session_id = %s", (sid,)) == 2
    assert pg.scalar("SELECT count(*) FROM yuxi.turns WHERE session_id = %s", (sid,)) == 2
    assert pg.scalar(received, (sid,)) == events_after_first + 1

    for receipt, text in ((first, "only once"), (racing[0], "raced")):
        assert (await wait_turn_done(c, receipt["turn_id"]))["status"] == "completed"
        assert (await result_of(c, receipt["turn_id"]))["output"]["text"] == f"done: {text}"
    # A replay after completion still returns the same receipt, now completed.
    late = await post_input(c, sid, "only once", mode="queue", client_request_id="req-1")
    assert (late["input_id"], late["turn_id"], late["status"]) == (
        first["input_id"], first["turn_id"], "completed")
    assert pg.scalar("SELECT count(*) FROM yuxi.inputs WHERE session_id = %s", (sid,)) == 2
