"""Cancelling a turn that waits (`waiting` or `waiting_user`) pauses its
session's queue until "continue" (seed: "cancel waiting turn pauses queue
until continue"); cancelling a queued or running turn pauses nothing. The
pause is written by cancel_turn_v1 in the transaction of the cancel intent,
so the cleanup that ends the turn later neither starts the queue nor undoes
a continue. Races are two-connection interleavings on the tree row."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.integration import gated
from tests.integration.helpers import (
    drain, events, executor, new_session, rewrite_function, rows, runs_with_status, scalar,
)
from tests.integration.test_cancellation import assert_paired
from tests.integration.test_cooperation_tools import running
from yuxi.errors import IllegalTransition
from yuxi.runtime import cleanup, cooperation
from yuxi.services import conversation, sessions

# The line of cancel_turn_v1 that pauses (the negative cases remove it).
PAUSE_LINE = "PERFORM yuxi.pause_queue_v1(v_turn.session_id, p_turn, 'cancel');"
PAUSE_CONDITION = "IF v_turn.status IN ('waiting', 'waiting_user') THEN"

ASK = {"call": [{"tool": "ask_user", "args": {"questions": [
    {"id": "pick", "question": "Which?", "options": ["x", "y"]}]}}]}
SCRIPT = {"model": "replay", "tools": ["cooperation", "ask_user"], "replay": {
    "rules": [
        {"match": "^ask", "steps": [ASK, {"say": "picked {{ last.answers.pick }}"}]},
        {"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "child"}}]},
            {"call": [{"tool": "wait_sessions", "args": {"sessions": ["c"], "timeout_s": 600}}]},
            {"say": "never"}]}],
    "default": [{"say": "ran {{ input }}"}]}}


async def _status(pool, turn_id) -> str:
    return await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s", (turn_id,))


async def _paused(pool, session_id) -> bool:
    return await scalar(pool, "SELECT queue_paused FROM yuxi.sessions WHERE id = %s", (session_id,))


async def _waiting_with_a_queued_input(pool, checkpoint_pool, scope, kind: str):
    """A session whose turn waits (`waiting`: on a child it created;
    `waiting_user`: on an ask_user question) with an input queued behind it."""
    session = await new_session(pool, scope, SCRIPT)
    first = await sessions.receive_input(pool, scope, session.id,
                                         content="ask" if kind == "waiting_user" else "parent")
    queued = await sessions.receive_input(pool, scope, session.id, content="later", mode="queue")
    assert queued.status == "queued"
    run_id = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (first.turn_id,))
    # Only this run executes (a child it creates stays ready).
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(run_id) == "suspended"
    assert await _status(pool, first.turn_id) == kind
    assert not await _paused(pool, session.id)
    return session, first, queued


async def _cancel_and_clean(pool, checkpoint_pool, scope, session, turn_id) -> None:
    assert (await sessions.cancel_turn(pool, scope, turn_id)).status == "cancelling"
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, turn_id)
    assert await _status(pool, turn_id) == "cancelled"
    # finish_cancel_v1 starts the next queued turn in its own transaction: if
    # the queue were open, the head would be `running` now.
    await drain(pool, checkpoint_pool)


@pytest.mark.parametrize("kind", ["waiting", "waiting_user"])
async def test_cancelling_a_waiting_turn_pauses_its_queue_until_continue(
        pool, checkpoint_pool, alice, kind):
    scope = alice[1]
    session, first, queued = await _waiting_with_a_queued_input(pool, checkpoint_pool, scope, kind)
    assert (await sessions.cancel_turn(pool, scope, first.turn_id)).status == "cancelling"
    # Written with the cancel intent, in one transaction: the session row and
    # the turn row were last written by the same transaction, which also holds
    # both events.
    xmins = await rows(pool, """
        SELECT (SELECT xmin::text FROM yuxi.sessions WHERE id = %(s)s) AS session,
               (SELECT xmin::text FROM yuxi.turns WHERE id = %(t)s) AS turn,
               (SELECT array_agg(DISTINCT xmin::text) FROM yuxi.events
                 WHERE turn_id = %(t)s AND type IN ('turn.cancelling', 'queue.paused')) AS events
        """, {"s": session.id, "t": first.turn_id})
    assert xmins[0]["session"] == xmins[0]["turn"] and xmins[0]["events"] == [xmins[0]["turn"]]
    # Visible: the session, the tree and an event.
    state = await sessions.get_session(pool, scope, session.id)
    assert (state.queue.length, state.queue.paused) == (1, True)
    tree = {m["path"]: m["queue"] for m in await sessions.get_tree(pool, scope, session.id)}
    assert tree["/root"] == {"length": 1, "paused": True}
    paused = [e for e in await events(pool, session.tree_id) if e["type"] == "queue.paused"]
    assert [(e["session_id"], e["turn_id"], e["data"]) for e in paused] == [
        (session.id, first.turn_id, {"reason": "cancel"})]
    # The cleanup ends the turn; the queue stays paused and nothing starts.
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, first.turn_id)
    assert await _status(pool, first.turn_id) == "cancelled"
    assert_paired(await conversation.messages(checkpoint_pool, session.id))
    await drain(pool, checkpoint_pool)
    assert await _status(pool, queued.turn_id) == "queued"
    assert await _paused(pool, session.id)
    if kind == "waiting":
        # Only the cancelled turn's session pauses: its child went on.
        assert await scalar(pool, "SELECT bool_or(queue_paused) FROM yuxi.sessions "
                                  "WHERE parent_id IS NOT NULL") is False
        assert await scalar(pool, "SELECT t.status FROM yuxi.turns t JOIN yuxi.sessions s "
                                  "ON s.id = t.session_id WHERE s.name = 'c'") == "completed"
    # Continue: FIFO head first, the cancelled turn stays cancelled.
    resumed = await sessions.continue_queue(pool, scope, session.id)
    assert not resumed.queue.paused
    assert await _status(pool, queued.turn_id) == "running"
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, queued.turn_id)).output["text"] == "ran later"
    assert await _status(pool, first.turn_id) == "cancelled"


async def test_without_the_pause_the_queued_input_runs_on_its_own(pool, checkpoint_pool, alice):
    # Negative case (the bug of issue 18): without the pause line the queued
    # input starts when the cleanup ends, and completes with nobody asking.
    await rewrite_function(pool, "yuxi.cancel_turn_v1", PAUSE_LINE, "NULL;")
    scope = alice[1]
    session, first, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    await _cancel_and_clean(pool, checkpoint_pool, scope, session, first.turn_id)
    assert await _status(pool, queued.turn_id) == "completed"
    assert not await _paused(pool, session.id)


async def test_the_cancel_turn_tool_pauses_the_queue_of_a_waiting_child(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope, config=SCRIPT)
    child = await cooperation.create_session(ctx("mk"), {"name": "c", "task": "ask me"})
    child_id, child_turn = uuid.UUID(child["session_id"]), uuid.UUID(child["turn_id"])
    queued = await sessions.receive_input(pool, scope, child_id, content="later", mode="queue")
    (child_run,) = [r for r in await runs_with_status(pool, "ready")
                    if await scalar(pool, "SELECT session_id FROM yuxi.runs WHERE id = %s",
                                    (r,)) == child_id]
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(child_run) == "suspended"
    assert await _status(pool, child_turn) == "waiting_user"
    out = await cooperation.cancel_turn(ctx("cx"), {"session": "c", "turn_id": str(child_turn)})
    assert out["status"] == "cancelling"
    assert await _paused(pool, child_id)
    assert not await _paused(pool, run["session_id"])  # the caller's queue is its own
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, child_turn)
    assert await _status(pool, queued.turn_id) == "queued"


# --------------------------------------------------------------------------
# Queued and running turns: nothing pauses.


async def _cancel_a_turn_whose_run_is_ready(pool, checkpoint_pool, scope):
    """A running turn whose run holds a slot but is not executing yet, with
    an input queued behind it: cancelled, cleaned; returns the queued turn."""
    session = await new_session(pool, scope, SCRIPT)
    first = await sessions.receive_input(pool, scope, session.id, content="first")
    queued = await sessions.receive_input(pool, scope, session.id, content="later", mode="queue")
    assert await _status(pool, first.turn_id) == "running"
    await _cancel_and_clean(pool, checkpoint_pool, scope, session, first.turn_id)
    return session, queued


async def test_cancelling_a_running_or_queued_turn_pauses_nothing(pool, checkpoint_pool, alice):
    scope = alice[1]
    session, queued = await _cancel_a_turn_whose_run_is_ready(pool, checkpoint_pool, scope)
    assert await _status(pool, queued.turn_id) == "completed"
    # A queued turn: cancelled at once, the one after it runs.
    a = await sessions.receive_input(pool, scope, session.id, content="a")
    b = await sessions.receive_input(pool, scope, session.id, content="b", mode="queue")
    c = await sessions.receive_input(pool, scope, session.id, content="c", mode="queue")
    assert (await sessions.cancel_turn(pool, scope, b.turn_id)).status == "cancelled"
    await drain(pool, checkpoint_pool)
    assert [await _status(pool, r.turn_id) for r in (a, b, c)] == ["completed", "cancelled",
                                                                    "completed"]
    assert not await _paused(pool, session.id)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'queue.paused'") == 0


async def test_a_cancel_met_by_the_executing_worker_pauses_nothing(pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await gated.start_run(pool, checkpoint_pool, scope, {
            "model": "gated", "replay": {"default": [{"say": "{{ input }}"}]}})
        queued = await sessions.receive_input(pool, scope, session.id, content="later",
                                              mode="queue")
        await gate.calls.get()
        assert (await sessions.cancel_turn(pool, scope, receipt.turn_id)).status == "running"
        gate.opened.set()
        assert await task == "cancelled"
        assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, receipt.turn_id)
        await drain(pool, checkpoint_pool)
    assert await _status(pool, queued.turn_id) == "completed"
    assert not await _paused(pool, session.id)


async def test_without_the_waiting_condition_a_running_cancel_would_pause(
        pool, checkpoint_pool, alice):
    # Negative case: pausing on every cancel that enters `cancelling` would
    # stop the queue behind a running turn too.
    await rewrite_function(pool, "yuxi.cancel_turn_v1", PAUSE_CONDITION, "IF true THEN")
    session, queued = await _cancel_a_turn_whose_run_is_ready(pool, checkpoint_pool, alice[1])
    assert await _status(pool, queued.turn_id) == "queued"
    assert await _paused(pool, session.id)


# --------------------------------------------------------------------------
# Races, as two-connection interleavings on the tree row: the first mover
# holds it (uncommitted) on its own connection, the second is a service call
# that blocks until the first commits.


async def _until_blocked(pool) -> None:
    """Wait until a backend of this test's database waits for a lock."""
    for _ in range(500):
        if await scalar(pool, """SELECT count(*) FROM pg_locks l
                                   JOIN pg_stat_activity a ON a.pid = l.pid
                                  WHERE NOT l.granted AND a.datname = current_database()"""):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the second call never waited for the tree row")


async def _interleave(db_url, pool, first_sql: str, params: tuple, second):
    """`first_sql` runs on its own connection and holds its transaction open
    while `second()` starts and blocks; then the first commits. Returns the
    first's value and the second's outcome (value or exception)."""
    async with await psycopg.AsyncConnection.connect(db_url) as conn:
        value = (await (await conn.execute(first_sql, params)).fetchone())[0]
        task = asyncio.create_task(second())
        await _until_blocked(pool)
        assert not task.done()
        await conn.commit()
    outcome = await asyncio.gather(task, return_exceptions=True)
    return value, outcome[0]


async def test_a_continue_before_the_cleanup_ends_is_not_undone(pool, checkpoint_pool, alice):
    scope = alice[1]
    session, first, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    await sessions.cancel_turn(pool, scope, first.turn_id)
    resumed = await sessions.continue_queue(pool, scope, session.id)
    # The turn is still being cleaned: the head waits for it, the queue is open.
    assert not resumed.queue.paused and await _status(pool, first.turn_id) == "cancelling"
    assert await _status(pool, queued.turn_id) == "queued"
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, first.turn_id)
    assert not await _paused(pool, session.id)
    await drain(pool, checkpoint_pool)
    assert await _status(pool, queued.turn_id) == "completed"


async def test_a_cleanup_that_wrote_the_pause_would_undo_the_continue(
        pool, checkpoint_pool, alice):
    # Negative case: a pause written when the cleanup ends (instead of with
    # the intent) re-pauses a queue its user continued meanwhile.
    await rewrite_function(pool, "yuxi.finish_cancel_v1",
                           "PERFORM yuxi.start_next_turn_v1(v_turn.session_id);",
                           "PERFORM yuxi.pause_queue_v1(v_turn.session_id, p_turn, 'cancel');"
                           " PERFORM yuxi.start_next_turn_v1(v_turn.session_id);")
    scope = alice[1]
    session, first, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    await sessions.cancel_turn(pool, scope, first.turn_id)
    await sessions.continue_queue(pool, scope, session.id)
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, first.turn_id)
    await drain(pool, checkpoint_pool)
    assert await _paused(pool, session.id)
    assert await _status(pool, queued.turn_id) == "queued"


@pytest.mark.parametrize("first", ["finish_cancel", "continue"])
async def test_continue_and_the_end_of_the_cleanup_in_either_order(
        pool, checkpoint_pool, alice, db_url, first):
    scope = alice[1]
    session, turn, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    await sessions.cancel_turn(pool, scope, turn.turn_id)
    if first == "finish_cancel":
        await cleanup.clean_checkpoint(checkpoint_pool, session.id)
        _, outcome = await _interleave(
            db_url, pool, "SELECT yuxi.finish_cancel_v1(%s)", (turn.turn_id,),
            lambda: sessions.continue_queue(pool, scope, session.id))
        assert not outcome.queue.paused
    else:
        _, outcome = await _interleave(
            db_url, pool, "SELECT yuxi.continue_queue_v1(%s, %s, %s)",
            (scope.user_id, scope.app_id, session.id),
            lambda: cleanup.clean_cancelled_turn(pool, checkpoint_pool, turn.turn_id))
        assert outcome is True
    assert await _status(pool, turn.turn_id) == "cancelled"
    assert not await _paused(pool, session.id)
    assert await _status(pool, queued.turn_id) == "running"
    await drain(pool, checkpoint_pool)
    assert await _status(pool, queued.turn_id) == "completed"


async def test_cancel_then_answer_the_answer_is_refused(pool, checkpoint_pool, alice, db_url):
    scope = alice[1]
    session, turn, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    # The answer read the pending wait before the cancel committed.
    status, outcome = await _interleave(
        db_url, pool, "SELECT yuxi.cancel_turn_v1(%s, %s, NULL, %s)",
        (scope.user_id, scope.app_id, turn.turn_id),
        lambda: sessions.answer_turn(pool, scope, turn.turn_id, answers={"pick": "y"}))
    assert status == "cancelling"
    assert isinstance(outcome, IllegalTransition)  # 409 through the API
    assert await scalar(pool, "SELECT status FROM yuxi.waits WHERE turn_id = %s",
                        (turn.turn_id,)) == "cancelled"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE turn_id = %s",
                        (turn.turn_id,)) == 1  # no resume run
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, turn.turn_id)
    await drain(pool, checkpoint_pool)
    assert await _paused(pool, session.id)
    assert await _status(pool, queued.turn_id) == "queued"


async def test_answer_then_cancel_cancels_a_running_turn(pool, checkpoint_pool, alice, db_url):
    # Documented outcome: the turn ends cancelled either way. An answer that
    # committed first made it `running` (a resume run), so the cancel is a
    # running turn's: its resume run never executes, and nothing pauses.
    scope = alice[1]
    session, turn, queued = await _waiting_with_a_queued_input(
        pool, checkpoint_pool, scope, "waiting_user")
    wait = (await rows(pool, "SELECT id, request FROM yuxi.waits WHERE turn_id = %s",
                       (turn.turn_id,)))[0]
    interrupt_id = wait["request"]["questions"][0]["interrupt_id"]
    resume_run, outcome = await _interleave(
        db_url, pool, "SELECT yuxi.answer_turn_v1(%s, %s, %s, %s, %s)",
        (scope.user_id, scope.app_id, turn.turn_id, wait["id"],
         Jsonb({interrupt_id: {"pick": "y"}})),
        lambda: sessions.cancel_turn(pool, scope, turn.turn_id))
    assert outcome.status == "cancelling"
    assert await scalar(pool, "SELECT status FROM yuxi.runs WHERE id = %s",
                        (resume_run,)) == "cancelled"
    assert not await _paused(pool, session.id)
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, turn.turn_id)
    assert_paired(await conversation.messages(checkpoint_pool, session.id))
    await drain(pool, checkpoint_pool)
    assert await _status(pool, turn.turn_id) == "cancelled"
    assert await _status(pool, queued.turn_id) == "completed"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'queue.paused'") == 0
