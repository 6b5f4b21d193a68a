"""Exact cancellation: queued turns end at once, running turns converge at
the next model or tool boundary, waiting turns are cleaned with the
checkpoint-only graph (three commits, each safe to retry); stop-all and
continue."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from tests.integration import gated
from tests.integration.helpers import (
    drain, executor, new_session, rows, runs_with_status, scalar, rewrite_function,
    rewrite_function_sync,
)
from tests.integration.test_config import wait_until_blocked
from yuxi.runtime import cleanup
from yuxi.services import conversation, sessions


async def _clean(pool, checkpoint_pool, turn_id):
    """What the cleanup_turn job does."""
    return await cleanup.clean_cancelled_turn(pool, checkpoint_pool, turn_id)


def assert_paired(messages: list[dict]) -> None:
    """Every tool call of every AI message has exactly one result."""
    calls = [c["id"] for m in messages if m["role"] == "ai" for c in m.get("tool_calls", [])]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert sorted(calls) == sorted(results), messages


async def test_queued_turn_is_cancelled_at_once_and_the_next_one_runs(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope)
    first = await sessions.receive_input(pool, scope, session.id, content="a", mode="queue")
    second = await sessions.receive_input(pool, scope, session.id, content="b", mode="queue")
    third = await sessions.receive_input(pool, scope, session.id, content="c", mode="queue")
    turn = await sessions.cancel_turn(pool, scope, second.turn_id)
    assert turn.status == "cancelled" and turn.result_run_id is None
    await drain(pool, checkpoint_pool)
    statuses = [(await sessions.get_turn(pool, scope, r.turn_id)).status for r in (first, second, third)]
    assert statuses == ["completed", "cancelled", "completed"]
    assert (await sessions.get_input(pool, scope, second.input_id)).status == "cancelled"


async def _gated_run(pool, checkpoint_pool, scope, steps):
    return await gated.start_run(pool, checkpoint_pool, scope, {
        "model": "gated", "tools": ["echo"], "replay": {"default": steps}})


async def test_cancel_during_the_final_answer_never_completes(pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _gated_run(pool, checkpoint_pool, scope,
                                                  [{"say": "the answer"}])
        await gate.calls.get()
        turn = await sessions.cancel_turn(pool, scope, receipt.turn_id)
        assert turn.status == "running"  # the intent is committed; the worker converges
        gate.opened.set()
        assert await task == "cancelled"
    assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s",
                        (receipt.turn_id,)) == "cancelling"
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "cancelled" and result.output is None
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'turn.completed'") == 0


async def test_cancel_at_the_tool_boundary_pairs_every_call(pool, checkpoint_pool, alice):
    scope = alice[1]
    calls = {"call": [{"tool": "echo", "args": {"text": "a"}}, {"tool": "echo", "args": {"text": "b"}}]}
    with gated.gated_model() as gate:
        session, receipt, task = await _gated_run(pool, checkpoint_pool, scope,
                                                  [calls, {"say": "never"}])
        await gate.calls.get()
        await sessions.cancel_turn(pool, scope, receipt.turn_id)
        gate.opened.set()
        assert await task == "cancelled"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'tool.started'") == 0
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    history = await conversation.messages(checkpoint_pool, session.id)
    assert_paired(history)
    assert all(m["content"] == cleanup.CANCELLED_RESULT for m in history if m["role"] == "tool")
    # The session goes on normally, with a valid conversation.
    nxt = await sessions.receive_input(pool, scope, session.id, content="next")
    with gated.gated_model() as gate:
        gate.opened.set()
        await drain(pool, checkpoint_pool)
    assert (await sessions.get_turn(pool, scope, nxt.turn_id)).status == "completed"


async def test_waiting_turn_cleanup_keeps_finished_results_and_children(
        pool, checkpoint_pool, alice, postgresql):
    # Guard: the cleanup's merge step (cleanup.merge_finished_writes) keeps
    # the result of create_session c2, finished beside the waiting call.
    scope = alice[1]
    root = await new_session(pool, scope, {"model": "replay", "tools": ["cooperation"], "replay": {
        "rules": [{"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c1", "task": "one"}}]},
            {"call": [{"tool": "create_session", "args": {"name": "c2", "task": "two"}},
                      {"tool": "wait_sessions", "args": {"sessions": ["c1"], "timeout_s": 600}}]},
            {"say": "not reached"}]}],
        "default": [{"say": "child done", "delay_ms": 0}]}})
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    parent_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    # Only the parent runs: it creates both children and waits on the first.
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    turn = await sessions.cancel_turn(pool, scope, receipt.turn_id)
    assert turn.status == "cancelling"
    assert await scalar(pool, "SELECT status FROM yuxi.waits") == "cancelled"
    job = await scalar(pool, "SELECT args->>'turn_id' FROM procrastinate.procrastinate_jobs "
                             "WHERE task_name = 'cleanup_turn'")
    assert job == str(receipt.turn_id)
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    history = await conversation.messages(checkpoint_pool, root.id)
    assert_paired(history)
    tools = [(m["name"], m["content"]) for m in history if m["role"] == "tool"]
    # Finished results are kept (once each), the waiting call gets the cancellation.
    assert [name for name, _ in tools] == ["create_session", "create_session", "wait_sessions"]
    assert '"path":"/root/c2"' in tools[1][1]
    assert tools[2][1] == cleanup.CANCELLED_RESULT
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "cancelled"
    # A parent's cancel never kills its children.
    await drain(pool, checkpoint_pool)
    children = await rows(pool, "SELECT t.status FROM yuxi.turns t JOIN yuxi.sessions s "
                                "ON s.id = t.session_id WHERE s.parent_id IS NOT NULL")
    assert [c["status"] for c in children] == ["completed", "completed"]


async def _suspended_with_a_finished_sibling(pool, checkpoint_pool, scope):
    """A parent suspended on a wait whose sibling call (echo "kept") finished:
    its result is only a pending write of the interrupted step."""
    root = await new_session(pool, scope, {"model": "replay", "tools": ["cooperation", "echo"],
        "replay": {"rules": [{"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "t"}}]},
            {"call": [{"tool": "echo", "args": {"text": "kept"}},
                      {"tool": "wait_sessions", "args": {"sessions": ["c"], "timeout_s": 600}}]}]}],
            "default": [{"say": "child"}]}})
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    parent_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    return root, receipt


@pytest.mark.parametrize("crash_after", [1, 2])
async def test_cleanup_converges_after_a_crash_at_each_commit(
        pool, checkpoint_pool, alice, crash_after):
    # Guards: each step checks from committed state whether it is still
    # needed; the merge step (cleanup.merge_finished_writes) keeps "kept".
    scope = alice[1]
    root, receipt = await _suspended_with_a_finished_sibling(pool, checkpoint_pool, scope)
    await sessions.cancel_turn(pool, scope, receipt.turn_id)
    # The cleanup dies after `crash_after` commits, then the job runs again.
    assert await cleanup.clean_checkpoint(checkpoint_pool, root.id,
                                          stop_after=crash_after) == crash_after
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    history = await conversation.messages(checkpoint_pool, root.id)
    assert_paired(history)
    assert [m["name"] for m in history if m["role"] == "tool"] == \
        ["create_session", "echo", "wait_sessions"]
    assert [m["content"] for m in history if m["role"] == "tool"][1] == '{"text":"kept"}'
    # Nothing is left to do: a third run of the cleanup commits nothing.
    assert await cleanup.clean_checkpoint(checkpoint_pool, root.id) == 0


async def test_stop_all_cancels_the_tree_and_continue_resumes_the_queue(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    root = await new_session(pool, scope, {"model": "replay", "tools": ["cooperation"], "replay": {
        "rules": [{"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "t"}}]},
            {"call": [{"tool": "wait_sessions", "args": {"sessions": ["c"], "timeout_s": 600}}]},
            {"say": "never"}]}],
        "default": [{"say": "done {{ input }}"}]}})
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    parent_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    child = await scalar(pool, "SELECT id FROM yuxi.sessions WHERE name = 'c'")
    queued = await sessions.receive_input(pool, scope, child, content="later", mode="queue")
    # Stop from the child: the whole tree stops.
    assert await sessions.stop_tree(pool, scope, child) == 2
    for turn_id in await rows(pool, "SELECT id FROM yuxi.turns WHERE status = 'cancelling'"):
        await _clean(pool, checkpoint_pool, turn_id["id"])
    states = await rows(pool, "SELECT s.path, t.status FROM yuxi.turns t JOIN yuxi.sessions s "
                              "ON s.id = t.session_id ORDER BY t.seq")
    assert states == [{"path": "/root", "status": "cancelled"},
                      {"path": "/root/c", "status": "cancelled"},
                      {"path": "/root/c", "status": "queued"}]
    assert await scalar(pool, "SELECT bool_and(queue_paused) FROM yuxi.sessions")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_turn(pool, scope, queued.turn_id)).status == "queued"
    resumed = await sessions.continue_queue(pool, scope, child)
    assert not resumed.queue.paused
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_turn(pool, scope, queued.turn_id)).status == "completed"
    # Continue never revives a cancelled turn.
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "cancelled"


STOP = "SELECT yuxi.stop_tree_v1(%s, %s, %s)"
CONTINUE = "SELECT yuxi.continue_queue_v1(%s, %s, %s)"


def _stop_then_continue_behind_a_starting_turn(db_url, postgresql):
    """Three connections, in this order: an input starts a turn on the idle
    root and stays uncommitted (it holds the tree row); a stop of the tree
    waits; a continue of the root, issued after the stop, waits too. Then
    the input commits, the stop ends and commits, the continue ends and
    commits. Returns (root, turn, turns the stop cancelled)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_slots import make_tree
    tree, (root,) = make_tree(postgresql, 1)
    user, app = postgresql.execute("SELECT user_id, app_id FROM yuxi.sessions WHERE id = %s",
                                   (root,)).fetchone()
    postgresql.commit()
    with psycopg.connect(db_url) as starter, psycopg.connect(db_url) as stopper, \
            psycopg.connect(db_url) as continuer, ThreadPoolExecutor(2) as threads:
        # Were there a deadlock, the continue would find it first (the shortest
        # deadlock_timeout) and be the one aborted.
        continuer.execute("SET deadlock_timeout = '50ms'")
        starter.execute("SELECT yuxi.receive_input_v1(%s, %s, %s, 'x', 'queue', '{}', NULL)",
                        (root, user, app))
        turn = starter.execute("SELECT id FROM yuxi.turns WHERE session_id = %s",
                               (root,)).fetchone()[0]
        stop = threads.submit(lambda: stopper.execute(STOP, (user, app, root)).fetchone()[0])
        wait_until_blocked(postgresql, stopper.info.backend_pid)
        cont = threads.submit(lambda: continuer.execute(CONTINUE, (user, app, root)).fetchone())
        wait_until_blocked(postgresql, continuer.info.backend_pid)
        starter.commit()
        stopped = stop.result(timeout=10)
        stopper.commit()
        cont.result(timeout=10)
        continuer.commit()
    return root, turn, stopped


def _tree_state(postgresql, root, turn):
    postgresql.rollback()
    return (postgresql.execute("SELECT status FROM yuxi.turns WHERE id = %s", (turn,)).fetchone()[0],
            postgresql.execute("SELECT queue_paused FROM yuxi.sessions WHERE id = %s",
                               (root,)).fetchone()[0],
            [r[0] for r in postgresql.execute(
                "SELECT type FROM yuxi.events WHERE tree_id = %s AND type IN "
                "('turn.started', 'turn.cancelling', 'tree.stopped', 'queue.continued') "
                "ORDER BY seq", (root,))])


def _stop_behind_a_member_started_meanwhile(db_url, postgresql):
    """The root's queue is paused already (an earlier stop). A transaction
    still open creates a member and starts a turn on it (holding the tree
    row); a stop of the tree is issued meanwhile. Returns (member, turn,
    turns the stop cancelled) once both committed. Every queue the stop can
    see is paused, so only its own tree lock makes it wait for that
    transaction (pausing an open queue would take the lock too: its
    queue.paused event)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_slots import make_tree
    tree, (root,) = make_tree(postgresql, 1)
    user, app = postgresql.execute("UPDATE yuxi.sessions SET queue_paused = true WHERE id = %s "
                                   "RETURNING user_id, app_id", (root,)).fetchone()
    postgresql.commit()
    with psycopg.connect(db_url) as starter, psycopg.connect(db_url) as stopper, \
            ThreadPoolExecutor(1) as threads:
        member = starter.execute(
            """INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, name, path,
                                          config)
               VALUES (gen_random_uuid(), %s, %s, %s, %s, 'late', '/root/late', '{}')
               RETURNING id""", (root, root, user, app)).fetchone()[0]
        starter.execute("SELECT yuxi.receive_input_v1(%s, %s, %s, 'x', 'queue', '{}', NULL)",
                        (member, user, app))
        turn = starter.execute("SELECT id FROM yuxi.turns WHERE session_id = %s",
                               (member,)).fetchone()[0]
        stop = threads.submit(lambda: stopper.execute(STOP, (user, app, root)).fetchone()[0])
        wait_until_blocked(postgresql, stopper.info.backend_pid)
        starter.commit()
        stopped = stop.result(timeout=10)
        stopper.commit()
    postgresql.rollback()
    return member, turn, stopped


def test_stop_all_cancels_a_turn_that_started_before_it(db_url, postgresql):
    # Guard: stop_tree_v1 takes the tree lock before it reads the tree's
    # members and turns, so a turn that started in a transaction the stop
    # waited for is seen and cancelled, and its session's queue paused.
    member, turn, stopped = _stop_behind_a_member_started_meanwhile(db_url, postgresql)
    status, paused, _ = _tree_state(postgresql, member, turn)
    assert stopped == 1 and status == "cancelling" and paused is True


def test_without_the_tree_lock_stop_all_misses_a_turn_started_meanwhile(db_url, postgresql):
    # Negative case: stop_tree_v1 without its lock_tree_v1 reads the members
    # and turns at once; the member and turn still uncommitted are not among
    # them and go on (only its final event then waits for the tree row).
    rewrite_function_sync(postgresql, "yuxi.stop_tree_v1",
                          "PERFORM yuxi.lock_tree_v1(v_session.tree_id);", "")
    postgresql.commit()
    member, turn, stopped = _stop_behind_a_member_started_meanwhile(db_url, postgresql)
    status, paused, _ = _tree_state(postgresql, member, turn)
    assert stopped == 0 and status == "running" and paused is False


def test_an_old_stop_cannot_re_pause_a_queue_continued_after_it(db_url, postgresql):
    # Guard: continue_queue_v1 takes the tree lock before it writes the
    # session row, so a continue issued after a stop that waits for the tree
    # lands after that stop (the last word is the continue's).
    root, turn, _ = _stop_then_continue_behind_a_starting_turn(db_url, postgresql)
    _, paused, events = _tree_state(postgresql, root, turn)
    assert paused is False
    assert events[-2:] == ["tree.stopped", "queue.continued"]


def test_without_the_tree_lock_a_continue_after_an_old_stop_is_lost(db_url, postgresql):
    # Negative case: continue_queue_v1 without lock_tree_v1 writes the session
    # row first and then waits for the tree row behind the stop; the stop,
    # once it has the tree row, waits for that session row: a deadlock, the
    # continue is aborted and the old stop's pause stays.
    rewrite_function_sync(postgresql, "yuxi.continue_queue_v1",
                          "PERFORM yuxi.lock_tree_v1(v_session.tree_id);", "")
    postgresql.commit()
    with pytest.raises(psycopg.errors.DeadlockDetected):
        _stop_then_continue_behind_a_starting_turn(db_url, postgresql)
    _, paused, events = _tree_state(postgresql, *postgresql.execute(
        "SELECT session_id, id FROM yuxi.turns").fetchone())
    assert paused is True and events[-1] == "tree.stopped"


async def test_without_the_merge_step_a_finished_result_is_lost(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: the production cleanup (the cleanup_turn job's
    # clean_cancelled_turn) with only its merge step removed. Pairing the
    # calls (as_node="tool") before merging drops the pending write of the
    # call that had finished: echo "kept" is lost.
    async def no_merge(graph, cfg, state) -> bool:
        return False

    scope = alice[1]
    root, receipt = await _suspended_with_a_finished_sibling(pool, checkpoint_pool, scope)
    await sessions.cancel_turn(pool, scope, receipt.turn_id)
    monkeypatch.setattr(cleanup, "merge_finished_writes", no_merge)
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    history = await conversation.messages(checkpoint_pool, root.id)
    assert [m["name"] for m in history if m["role"] == "tool"] == \
        ["create_session", "wait_sessions"]
    assert '{"text":"kept"}' not in [m["content"] for m in history]


async def test_without_the_completion_check_a_cancelled_turn_completes(
        pool, checkpoint_pool, alice):
    # Negative case: if completing ignored a committed intent, a cancel during
    # the final answer would end as a completed result.
    await rewrite_function(pool, "yuxi.complete_run_v1",
                           "WHERE id = v_run.turn_id AND cancel_requested_at IS NOT NULL",
                           "WHERE false")
    scope = alice[1]
    with gated.gated_model() as gate:
        # No tool boundary before the answer: only the completion check stands.
        session, receipt, task = await _gated_run(pool, checkpoint_pool, scope,
                                                  [{"say": "the answer"}])
        await gate.calls.get()
        await sessions.cancel_turn(pool, scope, receipt.turn_id)
        gate.opened.set()
        assert await task == "completed"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "completed"


async def test_sweep_redelivers_a_lost_cleanup(pool, checkpoint_pool, alice):
    import datetime as dt
    from yuxi.services import runs
    scope = alice[1]
    session = await new_session(pool, scope)
    receipt = await sessions.receive_input(pool, scope, session.id, content="x")
    assert (await sessions.cancel_turn(pool, scope, receipt.turn_id)).status == "cancelling"
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET LOCAL search_path = procrastinate")
        await conn.execute("DELETE FROM procrastinate_jobs WHERE task_name = 'cleanup_turn'")
    assert await runs.redeliver_cleanups(pool, dt.timedelta(hours=1)) == 0  # too recent
    assert await runs.redeliver_cleanups(pool, dt.timedelta(0)) == 1
    assert await runs.redeliver_cleanups(pool, dt.timedelta(0)) == 0  # its job is there now
    assert await _clean(pool, checkpoint_pool, receipt.turn_id)
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "cancelled"
