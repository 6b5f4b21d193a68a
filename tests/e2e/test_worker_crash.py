"""`kill -9` of the worker in the middle of a run: the lease expires, the
recovery sweep of another worker fails that run explicitly and continues the
turn in a new run from the last checkpoint; the turn completes once, with
the right answer, and the event log stays gap-free and duplicate-free."""

from __future__ import annotations

import collections

import pytest

from tests.e2e.helpers import (
    client, has_event, ok, open_stream, post_input, result_of, session_with_script,
    wait_turn_done,
)

pytestmark = pytest.mark.e2e

SCRIPT = {
    "default": [
        {"call": [{"tool": "echo", "args": {"text": "echo of {{ input }}"}}]},
        # The worker is killed while this step "thinks".
        {"say": "final: {{ last.text }}", "delay_ms": 4000},
    ],
}


async def test_worker_killed_mid_run_turn_completes_once(start_worker, api, alice, pg):
    key, _ = alice
    worker_a = start_worker()
    async with client(api, key) as c:
        session = await session_with_script(c, SCRIPT, tools=["echo"])
        sid, tree = session["id"], session["tree_id"]
        async with open_stream(c, sid) as stream:
            receipt = await post_input(c, sid, "crash me", mode="queue")
            turn_id = receipt["turn_id"]
            # The tool round trip is done; the model step of 4 s is under way.
            await stream.read_until(has_event("tool.finished", turn_id=turn_id), timeout=30)
        first_run = next(e["run_id"] for e in stream.events if e["type"] == "run.started")
        assert pg.scalar("SELECT status FROM yuxi.runs WHERE id = %s", (first_run,)) == "running"

        worker_a.kill9()
        start_worker()

        turn = await wait_turn_done(c, turn_id, timeout=40)
        assert turn["status"] == "completed", turn

        runs = pg.rows("""SELECT id::text, attempt, status, error FROM yuxi.runs
                           WHERE turn_id = %s ORDER BY slot_seq""", (turn_id,))
        assert [r["status"] for r in runs] == ["failed", "completed"], runs
        assert runs[0]["id"] == first_run and runs[0]["attempt"] == 1
        assert "lease" in runs[0]["error"]
        assert runs[1]["attempt"] == 2 and runs[1]["error"] is None
        completed_run = runs[1]["id"]
        assert pg.scalar("SELECT result_run_id::text FROM yuxi.turns WHERE id = %s",
                         (turn_id,)) == completed_run
        assert [r["id"] for r in turn["runs"]] == [r["id"] for r in runs]

        result = await result_of(c, turn_id)
        assert result["run_id"] == completed_run
        assert result["output"]["text"] == "final: echo of crash me"

        # The conversation holds the round trip once.
        messages = ok(await c.get(f"/api/sessions/{sid}/messages"))
        assert [m["role"] for m in messages] == ["human", "ai", "tool", "ai"], messages

        events = pg.events(tree)
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        types = collections.Counter(e["type"] for e in events)
        assert types["turn.completed"] == 1 and types["turn.failed"] == 0
        assert types["run.completed"] == 1
        message_ids = [e["data"]["message_id"] for e in events if e["type"] == "message"]
        assert len(message_ids) == len(set(message_ids)) == 2, message_ids
        for kind in ("tool.started", "tool.finished"):
            calls = [e["data"]["call_id"] for e in events if e["type"] == kind]
            assert len(calls) == len(set(calls)) == 1, (kind, calls)
        failed = [e for e in events if e["type"] == "run.failed"]
        assert len(failed) == 1 and failed[0]["run_id"] == first_run
        assert failed[0]["data"]["retry_run_id"] == completed_run
        assert "lease" in failed[0]["data"]["error"]
        started = [e["run_id"] for e in events if e["type"] == "run.started"]
        assert started == [first_run, completed_run]
        # The event after the turn's completion is its last.
        assert events[-1]["type"] == "turn.completed"
