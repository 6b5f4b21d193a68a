"""A turn runs end to end through the real API and worker processes: SSE
shows it, the result endpoint and PostgreSQL agree on its exact result, and
the conversation holds the tool round trip. Negative: a turn's result is its
own, never "the latest output" of the session."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import (
    Db, client, has_event, ok, open_stream, post_input, result_of, session_with_script,
    wait_turn_done,
)

pytestmark = pytest.mark.e2e

SCRIPT = {
    "default": [
        {"call": [{"tool": "echo", "args": {"text": "echoed {{ input }}"}}]},
        {"say": "answer: {{ last.text }}"},
    ],
}


async def test_turn_end_to_end(worker, api, alice, pg):
    # One API and one worker for both parts: process start-up dominates.
    key, _ = alice
    async with client(api, key) as c:
        await turn_runs_end_to_end(c, pg)
        await result_is_the_turns_own_not_the_latest(c, pg)


async def turn_runs_end_to_end(c: httpx.AsyncClient, pg: Db) -> None:
    session = await session_with_script(c, SCRIPT, tools=["echo"], name="e2e")
    sid = session["id"]
    async with open_stream(c, sid) as stream:
        receipt = await post_input(c, sid, "hello world", mode="queue")
        turn_id = receipt["turn_id"]
        assert receipt["status"] == "started" and receipt["position"] is None
        await stream.read_until(has_event("turn.completed", turn_id=turn_id), timeout=30)

    types = [e["type"] for e in stream.events if e["turn_id"] == turn_id]
    assert types == ["input.received", "turn.started", "run.started", "message",
                     "tool.started", "tool.finished", "message", "run.completed",
                     "turn.completed"], types
    tool_call, answer = [e["data"] for e in stream.events if e["type"] == "message"]
    assert tool_call["tool_calls"][0]["name"] == "echo"
    assert tool_call["tool_calls"][0]["args"] == {"text": "echoed hello world"}
    assert answer["content"] == "answer: echoed hello world"

    result = await result_of(c, turn_id)
    assert result["status"] == "completed" and result["error"] is None
    assert result["output"]["text"] == "answer: echoed hello world"
    assert result["output"]["message_id"] == answer["message_id"]

    # The same result read back from PostgreSQL through result_run_id.
    row = pg.one("""SELECT t.status, t.result_run_id::text AS run_id, r.output,
                           r.status AS run_status
                      FROM yuxi.turns t JOIN yuxi.runs r ON r.id = t.result_run_id
                     WHERE t.id = %s""", (turn_id,))
    assert row["status"] == "completed" and row["run_status"] == "completed"
    assert row["run_id"] == result["run_id"]
    assert row["output"] == result["output"]
    assert pg.scalar("SELECT status FROM yuxi.inputs WHERE id = %s",
                     (receipt["input_id"],)) == "completed"

    messages = ok(await c.get(f"/api/sessions/{sid}/messages"))
    assert [m["role"] for m in messages] == ["human", "ai", "tool", "ai"], messages
    human, call, tool, final = messages
    assert human["content"] == "hello world"
    assert call["tool_calls"][0]["name"] == "echo"
    assert tool["tool_call_id"] == call["tool_calls"][0]["id"]
    assert tool["name"] == "echo"
    assert final["content"] == "answer: echoed hello world"
    assert final["id"] == result["output"]["message_id"]


async def result_is_the_turns_own_not_the_latest(c: httpx.AsyncClient, pg: Db) -> None:
    """A turn's result is bound to its result_run_id, so a later turn with a
    different answer never changes it."""
    session = await session_with_script(c, SCRIPT, tools=["echo"], name="negative")
    sid = session["id"]
    first = await post_input(c, sid, "first question", mode="queue")
    await wait_turn_done(c, first["turn_id"])
    before = await result_of(c, first["turn_id"])
    assert before["output"]["text"] == "answer: echoed first question"

    second = await post_input(c, sid, "second question", mode="queue")
    assert second["turn_id"] != first["turn_id"]
    assert (await wait_turn_done(c, second["turn_id"]))["status"] == "completed"
    latest = await result_of(c, second["turn_id"])
    assert latest["output"]["text"] == "answer: echoed second question"

    after = await result_of(c, first["turn_id"])
    assert after == before
    assert after["run_id"] != latest["run_id"]
    assert pg.scalar("SELECT r.output->>'text' FROM yuxi.turns t JOIN yuxi.runs r "
                     "ON r.id = t.result_run_id WHERE t.id = %s",
                     (first["turn_id"],)) == "answer: echoed first question"
