"""Cancellation, stop-all/continue and user answers through the real API and
a real worker."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (client, has_event, ok, open_stream, post_input, result_of,
                               session_with_script, wait_turn_done)

pytestmark = pytest.mark.e2e


async def test_cancel_running_turn_and_stop_continue(worker, api, alice, pg):
    key, _ = alice
    async with client(api, key) as http:
        session = await session_with_script(http, {"default": [
            {"call": [{"tool": "echo", "args": {"text": "slow"}}], "delay_ms": 1500},
            {"say": "never"}]}, tools=["echo"])
        sid = session["id"]
        async with open_stream(http, sid) as stream:
            receipt = await post_input(http, sid, "go")
            await stream.read_until(has_event("run.started"))
            cancelled = ok(await http.post(f"/api/turns/{receipt['turn_id']}/cancel"), 202)
            assert cancelled["status"] == "running"  # the intent is committed
            await stream.read_until(has_event("turn.cancelled"), timeout=20)
        turn = await wait_turn_done(http, receipt["turn_id"])
        assert turn["status"] == "cancelled"
        assert [r["status"] for r in turn["runs"]] == ["cancelled"]
        messages = ok(await http.get(f"/api/sessions/{sid}/messages"))
        calls = [c["id"] for m in messages for c in m.get("tool_calls", [])]
        assert calls == [m["tool_call_id"] for m in messages if m["role"] == "tool"]
        assert pg.scalar("SELECT count(*) FROM yuxi.events WHERE type = 'tool.started'") == 0

        # Stop all pauses the queue; continue resumes it, FIFO head first.
        ok(await http.post(f"/api/sessions/{sid}/stop"), 202)
        queued = await post_input(http, sid, "after the stop", mode="queue")
        assert queued["status"] == "queued"
        state = ok(await http.get(f"/api/sessions/{sid}"))
        assert state["queue"] == {"length": 1, "paused": True}
        ok(await http.post(f"/api/sessions/{sid}/queue/continue"))
        done = await wait_turn_done(http, queued["turn_id"], timeout=20)
        assert done["status"] == "completed"
        assert (await wait_turn_done(http, receipt["turn_id"]))["status"] == "cancelled"


async def test_questions_are_answered_through_the_api(worker, api, alice):
    key, _ = alice
    async with client(api, key) as http:
        session = await session_with_script(http, {"default": [
            {"call": [{"tool": "ask_user", "args": {"questions": [
                {"id": "pick", "question": "Which?", "options": ["x", "y"]}]}}]},
            {"say": "picked {{ last.answers.pick }}"}]}, tools=["ask_user"])
        sid = session["id"]
        async with open_stream(http, sid) as stream:
            receipt = await post_input(http, sid, "ask")
            await stream.read_until(has_event("turn.waiting_user"))
        turn = ok(await http.get(f"/api/turns/{receipt['turn_id']}"))
        assert turn["status"] == "waiting_user"
        assert turn["pending"]["questions"][0]["options"] == ["x", "y"]
        refused = await http.post(f"/api/sessions/{sid}/inputs", json={"content": "more"})
        assert refused.status_code == 409 and refused.json()["code"] == "waiting_for_user"
        incomplete = await http.post(f"/api/turns/{receipt['turn_id']}/answer",
                                     json={"answers": {}})
        assert incomplete.status_code == 422
        assert [e["field"] for e in incomplete.json()["errors"]] == ["answers.pick"]
        ok(await http.post(f"/api/turns/{receipt['turn_id']}/answer",
                           json={"answers": {"pick": "y"}}), 202)
        await wait_turn_done(http, receipt["turn_id"])
        assert (await result_of(http, receipt["turn_id"]))["output"]["text"] == "picked y"
