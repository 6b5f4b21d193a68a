"""Steer and queue: a steer joins the turn in flight at its next safe
boundary (before the next model call, never inside a tool batch); queue waits
in FIFO; a steer during what would have been the final answer still lands in
the same turn with one more model call."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration import gated
from tests.integration.helpers import (
    drain, executor, new_session, rows, runs_with_status, scalar, rewrite_function,
)
from yuxi.errors import WaitingForUser
from yuxi.services import conversation, sessions


def script(*steps) -> dict:
    return {"model": "gated", "tools": ["echo"], "replay": {"default": list(steps)}}


JOINED = {"say": "{{ inputs|join('+') }} via {{ model }}"}
TOOL = {"call": [{"tool": "echo", "args": {"text": "t"}}]}


async def _start(pool, checkpoint_pool, scope, config, content="a"):
    return await gated.start_run(pool, checkpoint_pool, scope, config, content)


async def test_steer_joins_the_running_turn_before_the_next_model_call(pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _start(pool, checkpoint_pool, scope, script(TOOL, JOINED))
        assert await gate.calls.get() == 1  # the first model call is in progress
        steer = await sessions.receive_input(pool, scope, session.id, content="b")
        assert (steer.turn_id, steer.status, steer.position) == (receipt.turn_id, "queued", None)
        gate.opened.set()
        assert await task == "completed"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns") == 1
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "a+b via gated"
    # The steer landed after the tool batch, before the second model call.
    roles = [(m["role"], m["content"]) for m in
             await conversation.messages(checkpoint_pool, session.id)]
    assert [r for r, _ in roles] == ["human", "ai", "tool", "human", "ai"]
    assert roles[3] == ("human", "b")
    statuses = await rows(pool, "SELECT content, status FROM yuxi.inputs ORDER BY seq")
    assert statuses == [{"content": "a", "status": "completed"},
                        {"content": "b", "status": "completed"}]


async def test_steer_during_the_final_answer_gets_one_more_model_call(pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _start(pool, checkpoint_pool, scope, script(JOINED))
        await gate.calls.get()
        await sessions.receive_input(pool, scope, session.id, content="b")
        gate.opened.set()
        assert await task == "completed"
        assert gate.count == 2
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "a+b via gated"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns") == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs") == 1


async def test_several_steers_before_one_boundary_arrive_together_in_order(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _start(pool, checkpoint_pool, scope, script(TOOL, JOINED))
        await gate.calls.get()
        for text in ("b", "c", "d"):
            await sessions.receive_input(pool, scope, session.id, content=text)
        gate.opened.set()
        assert await task == "completed"
        assert gate.count == 2  # one boundary took all three
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "a+b+c+d via gated"
    delivered = await rows(pool, "SELECT data FROM yuxi.events WHERE type = 'input.delivered'")
    assert len(delivered) == 1 and len(delivered[0]["data"]["input_ids"]) == 3


async def test_queue_mode_waits_for_its_own_turn(pool, checkpoint_pool, alice):
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _start(pool, checkpoint_pool, scope, script(JOINED))
        await gate.calls.get()
        queued = await sessions.receive_input(pool, scope, session.id, content="q", mode="queue")
        assert queued.status == "queued" and queued.position == 1
        assert queued.turn_id != receipt.turn_id
        gate.opened.set()
        assert await task == "completed"
        await drain(pool, checkpoint_pool)
    first = await sessions.get_result(pool, scope, receipt.turn_id)
    second = await sessions.get_result(pool, scope, queued.turn_id)
    assert (first.output["text"], second.output["text"]) == ("a via gated", "q via gated")


async def test_idle_steer_batch_keeps_its_creation_config(pool, checkpoint_pool, alice):
    # The first steer starts a turn; before it runs the session's model
    # changes and a second steer joins: the whole batch runs with the config
    # the turn was created with.
    scope = alice[1]
    session = await new_session(pool, scope, {"model": "replay/one", "replay": {
        "default": [JOINED]}})
    first = await sessions.receive_input(pool, scope, session.id, content="a")
    await sessions.update_session(pool, scope, session.id, {"model": "replay/two"})
    second = await sessions.receive_input(pool, scope, session.id, content="b")
    assert second.turn_id == first.turn_id
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, first.turn_id)
    assert result.output["text"] == "a+b via replay/one"
    later = await sessions.receive_input(pool, scope, session.id, content="c")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, later.turn_id)).output["text"] == \
        "c via replay/two"


async def test_waiting_for_user_refuses_new_input_and_writes_nothing(pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope)
    receipt = await sessions.receive_input(pool, scope, session.id, content="a")
    # The approval/question wait itself belongs to a later capability: put
    # the turn in that state directly.
    await scalar(pool, "UPDATE yuxi.turns SET status = 'waiting_user' WHERE id = %s RETURNING id",
                 (receipt.turn_id,))
    before = await scalar(pool, "SELECT count(*) FROM yuxi.inputs")
    for mode in ("steer", "queue"):
        with pytest.raises(WaitingForUser) as err:
            await sessions.receive_input(pool, scope, session.id, content="b", mode=mode)
        assert err.value.code == "waiting_for_user"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs") == before


async def test_without_the_completion_check_a_late_steer_is_lost(pool, checkpoint_pool, alice):
    # Negative case: if completing ignored undelivered steers, the steer that
    # arrived during the final answer would end with the turn, never seen.
    await rewrite_function(pool, "yuxi.complete_run_v1", "IF EXISTS (SELECT 1 FROM yuxi.inputs i",
                           "IF false AND EXISTS (SELECT 1 FROM yuxi.inputs i")
    scope = alice[1]
    with gated.gated_model() as gate:
        session, receipt, task = await _start(pool, checkpoint_pool, scope, script(JOINED))
        await gate.calls.get()
        await sessions.receive_input(pool, scope, session.id, content="b")
        gate.opened.set()
        await task
        assert gate.count == 1
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "a via gated"  # "b" never reached the model
