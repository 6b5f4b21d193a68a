"""Issue 18 as a user meets it, through the real API and a real worker
process: cancelling a turn that waits for its user pauses the session's
queue until Continue; cancelling a running turn does not."""

from __future__ import annotations

import psycopg
import pytest

from tests.e2e.helpers import (client, has_event, ok, open_stream, post_input, result_of,
                               session_with_script, wait_turn_done)
from tests.integration.helpers import rewrite_function_sync
from tests.integration.test_cancel_waiting_pauses import PAUSE_LINE

pytestmark = pytest.mark.e2e

ASK = {"call": [{"tool": "ask_user", "args": {"questions": [
    {"id": "pick", "question": "Which?", "options": ["x", "y"]}]}}]}
SCRIPT = {"rules": [{"match": "^ask", "steps": [ASK, {"say": "picked {{ last.answers.pick }}"}]},
                    {"match": "^slow", "steps": [{"say": "slow done", "delay_ms": 2000}]}],
          "default": [{"say": "ran {{ input }}"}]}


@pytest.mark.parametrize("pause", [True, False], ids=["pause", "without-the-pause-line"])
async def test_cancel_waiting_turn_pauses_queue_until_continue(
        start_worker, api, alice, db_url, pause):
    if not pause:
        # Negative case: the bug as reported (the queued input runs at once).
        with psycopg.connect(db_url, autocommit=True) as conn:
            rewrite_function_sync(conn, "yuxi.cancel_turn_v1", PAUSE_LINE, "NULL;")
    key, _ = alice
    async with client(api, key) as http:
        sid = (await session_with_script(http, SCRIPT, tools=["ask_user"]))["id"]
        async with open_stream(http, sid) as stream:
            asking = await post_input(http, sid, "ask")
            queued = await post_input(http, sid, "later", mode="queue")
            assert queued["status"] == "queued"
            start_worker()  # only now: the second input is queued for sure
            await stream.read_until(has_event("turn.waiting_user"))
            cancelled = ok(await http.post(f"/api/turns/{asking['turn_id']}/cancel"), 202)
            assert cancelled["status"] == "cancelling"
            await stream.read_until(has_event("turn.cancelled"), timeout=20)
            # The transaction that wrote turn.cancelled would have started
            # the head of an open queue: what we read now is the outcome.
            head = ok(await http.get(f"/api/turns/{queued['turn_id']}"))
            state = ok(await http.get(f"/api/sessions/{sid}"))
            if not pause:
                assert head["status"] != "queued" and not state["queue"]["paused"]
                assert (await wait_turn_done(http, queued["turn_id"]))["status"] == "completed"
                return
            assert head["status"] == "queued"
            assert state["status"] == "idle"
            assert state["queue"] == {"length": 1, "paused": True}
            tree = ok(await http.get(f"/api/sessions/{sid}/tree"))
            assert [m["queue"] for m in tree["sessions"]] == [{"length": 1, "paused": True}]
            assert [(e["turn_id"], e["data"]) for e in stream.events
                    if e["type"] == "queue.paused"] == [(asking["turn_id"], {"reason": "cancel"})]
            # An answer that comes after the cancel is refused.
            late = await http.post(f"/api/turns/{asking['turn_id']}/answer",
                                   json={"answers": {"pick": "y"}})
            assert late.status_code == 409 and late.json()["code"] == "illegal_transition"
            # Continue: the head runs; the cancelled turn stays cancelled.
            resumed = ok(await http.post(f"/api/sessions/{sid}/queue/continue"))
            assert resumed["queue"]["paused"] is False
            await stream.read_until(has_event("turn.completed", turn_id=queued["turn_id"]))
            assert stream.types().index("queue.continued") < stream.types().index("turn.completed")
        assert (await result_of(http, queued["turn_id"]))["output"]["text"] == "ran later"
        assert (await wait_turn_done(http, asking["turn_id"]))["status"] == "cancelled"


async def test_cancel_running_turn_leaves_the_queue_open(start_worker, api, alice):
    key, _ = alice
    async with client(api, key) as http:
        sid = (await session_with_script(http, SCRIPT, tools=["ask_user"]))["id"]
        async with open_stream(http, sid) as stream:
            slow = await post_input(http, sid, "slow")
            queued = await post_input(http, sid, "later", mode="queue")
            assert queued["status"] == "queued"
            start_worker()
            await stream.read_until(has_event("run.started", turn_id=slow["turn_id"]))
            cancelled = ok(await http.post(f"/api/turns/{slow['turn_id']}/cancel"), 202)
            assert cancelled["status"] == "running"  # the intent; the worker converges
            await stream.read_until(has_event("turn.completed", turn_id=queued["turn_id"]))
            assert "queue.paused" not in stream.types()
        assert (await wait_turn_done(http, slow["turn_id"]))["status"] == "cancelled"
        assert ok(await http.get(f"/api/sessions/{sid}"))["queue"] == {"length": 0, "paused": False}
