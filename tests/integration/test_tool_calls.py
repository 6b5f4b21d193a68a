"""The check before each tool call (issue 15: one statement with the call's
`tool.started`, yuxi.start_tool_calls_v1): a committed cancel intent stops
the run before the call and records nothing; otherwise the event is
recorded, fenced by the lease."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.helpers import (
    events, new_session, rewrite_function, runs_with_status, scalar)
from yuxi.errors import LeaseLost
from yuxi.runtime.executor import EventReporter, TurnCancelled
from yuxi.services import runs, sessions

CALL = {"id": "call-1", "name": "echo", "args": {"text": "x"}}


async def _running(pool, scope):
    session = await new_session(pool, scope)
    receipt = await sessions.receive_input(pool, scope, session.id, content="x")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    assert await runs.start_run(pool, run_id, token, 30) is not None
    return session, receipt, EventReporter(pool, run_id, token, receipt.turn_id)


async def _tool_events(pool, session) -> list[str]:
    return [e["data"]["call_id"] for e in await events(pool, session.tree_id)
            if e["type"] == "tool.started"]


async def test_a_tool_call_starts_with_its_event(pool, alice):
    session, receipt, reporter = await _running(pool, alice[1])
    await reporter.tool_started(CALL)
    await reporter.tool_started(CALL)  # a re-executed step: one event
    assert await _tool_events(pool, session) == ["call-1"]


async def test_a_cancel_intent_stops_the_run_before_the_call(pool, alice):
    session, receipt, reporter = await _running(pool, alice[1])
    await scalar(pool, "UPDATE yuxi.turns SET cancel_requested_at = now() WHERE id = %s "
                       "RETURNING id", (receipt.turn_id,))
    with pytest.raises(TurnCancelled):
        await reporter.tool_started(CALL)
    assert await _tool_events(pool, session) == []


async def test_without_the_check_a_cancelled_turn_would_start_the_call(pool, alice):
    # Negative: the cancel check removed.
    await rewrite_function(pool, "yuxi.start_tool_calls_v1",
                           "AND t.cancel_requested_at IS NOT NULL", "AND false")
    session, receipt, reporter = await _running(pool, alice[1])
    await scalar(pool, "UPDATE yuxi.turns SET cancel_requested_at = now() WHERE id = %s "
                       "RETURNING id", (receipt.turn_id,))
    await reporter.tool_started(CALL)
    assert await _tool_events(pool, session) == ["call-1"]


async def test_a_lost_lease_records_nothing(pool, alice):
    session, receipt, reporter = await _running(pool, alice[1])
    reporter.token = uuid.uuid4()
    with pytest.raises(LeaseLost):
        await reporter.tool_started(CALL)
    assert await _tool_events(pool, session) == []


async def test_a_steps_events_take_the_trees_next_numbers_in_order_once_each(pool, alice):
    # emit_run_events_v1 numbers a batch set-based: the tree's next numbers,
    # in the calls' order, skipping a call already reported (a re-executed
    # step) and a call given twice, with no gap.
    session, receipt, reporter = await _running(pool, alice[1])
    await reporter.tool_started({**CALL, "id": "b"})
    before = await scalar(pool, "SELECT max(seq) FROM yuxi.events WHERE tree_id = %s",
                          (session.tree_id,))
    calls = [{**CALL, "id": i} for i in ("a", "b", "c", "c", "d")]
    assert await reporter._start_calls(calls) == [True] * 5
    rows = [e for e in await events(pool, session.tree_id) if e["seq"] > before]
    assert [(e["seq"], e["type"], e["data"]["call_id"]) for e in rows] == [
        (before + 1, "tool.started", "a"), (before + 2, "tool.started", "c"),
        (before + 3, "tool.started", "d")]
    assert all(e["run_id"] == reporter.run_id and e["turn_id"] == receipt.turn_id
               for e in rows)
    await reporter._finish_calls([({**CALL, "id": "a"}, "ra"), ({**CALL, "id": "d"}, "rd")])
    finished = [e for e in await events(pool, session.tree_id) if e["type"] == "tool.finished"]
    assert [(e["seq"], e["data"]["result"]) for e in finished] == [
        (before + 4, "ra"), (before + 5, "rd")]


async def test_a_batch_of_events_that_would_wake_waits_is_refused(pool, alice):
    # Those go through emit_event_v1, which wakes the waits: the set-based
    # batch would record them without waking anyone.
    session, receipt, reporter = await _running(pool, alice[1])
    with pytest.raises(Exception, match="wakes waits"):
        async with pool.connection() as conn:
            await conn.execute("SELECT yuxi.emit_run_events_v1(%s, %s, 'message.sent', "
                               "'[{\"data\": {}}]')", (reporter.run_id, reporter.token))
