"""Inputs, turns and runs on real PostgreSQL with the real executor."""

from __future__ import annotations

import pytest

from tests.integration.helpers import (
    drain, events, new_session, rewrite_function, rows, scalar, say_agent)
from yuxi.errors import InvalidRequest, NotFound
from yuxi.services import sessions


async def test_turn_runs_end_to_end(pool, checkpoint_pool, alice):
    _, scope = alice
    config = {"model": "replay", "tools": ["echo"], "replay": {"default": [
        {"call": [{"tool": "echo", "args": {"text": "<{{ input }}>"}}]},
        {"say": "got {{ last.text }} at {{ session.path }}"}]}}
    session = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, session.id, content="hi")
    assert receipt.status == "started" and receipt.turn_id is not None
    assert await drain(pool, checkpoint_pool) == ["completed"]

    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "completed"
    assert result.output["text"] == "got <hi> at /root"
    # Read back from the tables: the turn's result is its result run's output.
    stored = await rows(pool, """SELECT r.output->>'text' AS text, t.status, i.status AS input_status
                                  FROM yuxi.turns t JOIN yuxi.runs r ON r.id = t.result_run_id
                                  JOIN yuxi.inputs i ON i.id = t.input_id WHERE t.id = %s""",
                        (receipt.turn_id,))
    assert stored == [{"text": "got <hi> at /root", "status": "completed",
                       "input_status": "completed"}]
    types = [e["type"] for e in await events(pool, session.tree_id)]
    assert types == ["session.created", "input.received", "turn.started", "run.started",
                     "message", "tool.started", "tool.finished", "message",
                     "run.completed", "turn.completed"]
    # The slot was handed back.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims") == 0


async def test_queued_inputs_run_in_fifo_order_with_their_own_results(pool, checkpoint_pool, alice):
    _, scope = alice
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    receipts = [await sessions.receive_input(pool, scope, session.id, content=f"q{i}", mode="queue")
                for i in range(3)]
    assert [r.status for r in receipts] == ["started", "queued", "queued"]
    assert [r.position for r in receipts] == [None, 1, 2]
    await drain(pool, checkpoint_pool)
    for i, receipt in enumerate(receipts):
        result = await sessions.get_result(pool, scope, receipt.turn_id)
        assert result.output["text"] == f"answer to q{i}"
    finished = await rows(pool, "SELECT t.id FROM yuxi.turns t ORDER BY t.finished_at")
    assert [r["id"] for r in finished] == [r.turn_id for r in receipts]


# An input to an idle session is written started at once only when its
# queue is not paused and holds no older turn (sql/030_sessions.sql).
_PAUSED_GUARD = "AND NOT v_session.queue_paused"
_QUEUED_GUARD = ("AND NOT EXISTS (SELECT 1 FROM yuxi.turns\n"
                 "                               WHERE session_id = p_session AND status = 'queued')")


async def _paused_idle_session(pool, scope):
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    await scalar(pool, "UPDATE yuxi.sessions SET queue_paused = true WHERE id = %s RETURNING id",
                 (session.id,))
    return session


@pytest.mark.parametrize("guarded", [True, False])
async def test_an_input_to_a_paused_idle_session_waits(pool, checkpoint_pool, alice, guarded):
    _, scope = alice
    if not guarded:  # negative case: without the guard the turn starts anyway
        await rewrite_function(pool, "yuxi.receive_input_v1", _PAUSED_GUARD, "")
    session = await _paused_idle_session(pool, scope)
    receipt = await sessions.receive_input(pool, scope, session.id, content="q0", mode="queue")
    if not guarded:
        assert receipt.status == "started"
        return
    assert (receipt.status, receipt.position) == ("queued", 1)
    assert await drain(pool, checkpoint_pool) == []
    await sessions.continue_queue(pool, scope, session.id)
    assert await drain(pool, checkpoint_pool) == ["completed"]


@pytest.mark.parametrize("guarded", [True, False])
async def test_an_input_to_an_idle_session_never_passes_a_queued_turn(
        pool, checkpoint_pool, alice, guarded):
    _, scope = alice
    if not guarded:  # negative case: without the guard the new turn jumps the queue
        await rewrite_function(pool, "yuxi.receive_input_v1", _QUEUED_GUARD, "")
    session = await _paused_idle_session(pool, scope)
    first = await sessions.receive_input(pool, scope, session.id, content="q0", mode="queue")
    # An idle session with a queued turn and an open queue (as if the queue
    # had been opened without starting it): FIFO still holds.
    await scalar(pool, "UPDATE yuxi.sessions SET queue_paused = false WHERE id = %s RETURNING id",
                 (session.id,))
    second = await sessions.receive_input(pool, scope, session.id, content="q1", mode="queue")
    if not guarded:
        assert second.status == "started"
        return
    # The older turn starts first; the new one waits behind it.
    assert (second.status, second.position) == ("queued", 1)
    assert (await sessions.get_turn(pool, scope, first.turn_id)).status == "running"
    await drain(pool, checkpoint_pool)
    finished = await rows(pool, "SELECT t.id FROM yuxi.turns t ORDER BY t.finished_at")
    assert [r["id"] for r in finished] == [first.turn_id, second.turn_id]


async def test_only_one_turn_in_flight_per_session(pool, alice):
    _, scope = alice
    session = await new_session(pool, scope)
    for i in range(3):
        await sessions.receive_input(pool, scope, session.id, content=f"x{i}", mode="queue")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns WHERE status = 'running'") == 1
    # The guard is the partial unique index, not only the function's check.
    with pytest.raises(Exception, match="turns_one_active_per_session"):
        await scalar(pool, "UPDATE yuxi.turns SET status = 'running', started_at = now() "
                           "WHERE status = 'queued'")


async def test_client_request_id_returns_the_same_receipt(pool, alice):
    _, scope = alice
    session = await new_session(pool, scope)
    first = await sessions.receive_input(pool, scope, session.id, content="a",
                                         client_request_id="req-1")
    again = await sessions.receive_input(pool, scope, session.id, content="a",
                                         client_request_id="req-1")
    assert (again.input_id, again.turn_id) == (first.input_id, first.turn_id)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs") == 1
    other = await sessions.receive_input(pool, scope, session.id, content="a",
                                         client_request_id="req-2")
    assert other.input_id != first.input_id
    # The same key with another request is refused and writes nothing.
    from yuxi.errors import Conflict
    with pytest.raises(Conflict):
        await sessions.receive_input(pool, scope, session.id, content="b",
                                     client_request_id="req-1")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs") == 2


async def test_bad_input_is_refused_and_writes_nothing(pool, alice, mallory):
    _, scope = alice
    session = await new_session(pool, scope)
    with pytest.raises(InvalidRequest):
        await sessions.receive_input(pool, scope, session.id, content="   ")
    with pytest.raises(InvalidRequest):
        await sessions.receive_input(pool, scope, session.id, content="x", mode="later")
    with pytest.raises(InvalidRequest) as err:
        await sessions.receive_input(pool, scope, session.id, content="x", model="gpt-nope")
    assert err.value.code == "unknown_model"
    with pytest.raises(NotFound):
        await sessions.receive_input(pool, mallory[1], session.id, content="x")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs") == 0


async def test_model_template_error_fails_the_run_with_its_text(pool, checkpoint_pool, alice):
    _, scope = alice
    session = await new_session(pool, scope, say_agent("{{ nope.missing }}"))
    receipt = await sessions.receive_input(pool, scope, session.id, content="x")
    assert await drain(pool, checkpoint_pool) == ["failed"]
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "failed" and "nope" in result.error
    assert result.run_id is not None
    # The session is usable again: a next input starts a new turn.
    nxt = await sessions.receive_input(pool, scope, session.id, content="y")
    assert nxt.status == "started"


async def test_unknown_model_at_session_creation_is_refused(pool, alice):
    _, scope = alice
    with pytest.raises(InvalidRequest) as err:
        await new_session(pool, scope, {"model": "nonexistent"})
    assert err.value.code in ("invalid_request", "unknown_model")
    from yuxi.services import accounts
    agent = await accounts.create_agent(pool, scope, "ok", say_agent())
    with pytest.raises(InvalidRequest) as err:
        await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay",
                                      model="nope/x")
    assert err.value.code == "unknown_model"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions") == 0


async def test_max_steps_ends_a_runaway_turn(pool, checkpoint_pool, alice):
    _, scope = alice
    loop = {"default": [{"call": [{"tool": "echo", "args": {"text": "again"}}]}] * 50}
    for max_steps, outcome in ((3, "failed"), (25, "completed")):
        script = loop if outcome == "failed" else {"default": [
            {"call": [{"tool": "echo", "args": {"text": "once"}}]}, {"say": "done"}]}
        session = await new_session(pool, scope, {"model": "replay", "tools": ["echo"],
                                                  "max_steps": max_steps, "replay": script})
        receipt = await sessions.receive_input(pool, scope, session.id, content="go")
        assert await drain(pool, checkpoint_pool) == [outcome]
        result = await sessions.get_result(pool, scope, receipt.turn_id)
        if outcome == "failed":
            assert result.error == "max_steps_exceeded: the turn exceeded max_steps (3)"
