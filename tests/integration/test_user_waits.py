"""Waiting for a user: approvals (approval mode "confirm") and questions
(ask_user) suspend the turn in waiting_user; an answer resumes the same turn
in a new run; incomplete answers change nothing."""

from __future__ import annotations

import pytest

from tests.integration.helpers import drain, new_session, rows, scalar
from tests.integration.test_cancellation import assert_paired
from tests.integration.test_permissions import _grant_all
from yuxi.errors import IllegalTransition, InvalidRequest, WaitingForUser
from yuxi.runtime import cleanup
from yuxi.services import conversation, sessions

NOTE = {"call": [{"tool": "add_note", "args": {"collection": "docs", "text": "{{ input }}"}}]}
SAY_LAST = {"say": "{{ last.error.code if last.error is defined else 'noted' }}"}


async def _confirming(pool, checkpoint_pool, scope):
    await _grant_all(pool, scope)
    session = await new_session(pool, scope, {
        "model": "replay", "approval_mode": "confirm", "tools": ["add_note"],
        "resources": ["collection:docs", "tool_group:notes"],
        "replay": {"default": [NOTE, SAY_LAST]}})
    receipt = await sessions.receive_input(pool, scope, session.id, content="remember this")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    return session, receipt


@pytest.mark.parametrize("approve", [True, False])
async def test_confirm_mode_asks_before_a_side_effect(pool, checkpoint_pool, alice, approve):
    scope = alice[1]
    session, receipt = await _confirming(pool, checkpoint_pool, scope)
    turn = await sessions.get_turn(pool, scope, receipt.turn_id)
    assert turn.status == "waiting_user"
    (approval,) = turn.pending["approvals"]
    assert turn.pending["kind"] == "approval"
    assert (approval["tool"], approval["args"]) == (
        "add_note", {"collection": "docs", "text": "remember this"})
    assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 0
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims") == 0  # no slot held
    with pytest.raises(WaitingForUser):
        await sessions.receive_input(pool, scope, session.id, content="more")
    with pytest.raises(InvalidRequest) as err:
        await sessions.answer_turn(pool, scope, receipt.turn_id, decisions=[])
    assert err.value.errors[0]["field"] == f"decisions.{approval['call_id']}"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "waiting_user"
    await sessions.answer_turn(pool, scope, receipt.turn_id, decisions=[
        {"call_id": approval["call_id"], "approve": approve, "message": "not now"}])
    with pytest.raises(IllegalTransition):  # answered once
        await sessions.answer_turn(pool, scope, receipt.turn_id, decisions=[
            {"call_id": approval["call_id"], "approve": approve}])
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    runs_ = await rows(pool, "SELECT status FROM yuxi.runs WHERE turn_id = %s ORDER BY slot_seq",
                       (receipt.turn_id,))
    assert [r["status"] for r in runs_] == ["suspended", "completed"]
    if approve:
        assert result.output["text"] == "noted"
        assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 1
    else:
        assert result.output["text"] == "rejected_by_user"
        assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 0
        tool = [m for m in await conversation.messages(checkpoint_pool, session.id)
                if m["role"] == "tool"][0]
        assert "not now" in tool["content"]


QUESTIONS = {"call": [{"tool": "ask_user", "args": {"questions": [
    {"id": "color", "question": "Which color?", "options": ["red", "blue"]},
    {"id": "tags", "question": "Which tags?", "options": ["a", "b", "c"], "multi_select": True},
    {"id": "why", "question": "Why?"}]}}]}


async def test_questions_need_complete_answers_and_resume_the_same_turn(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope, {"model": "replay", "tools": ["ask_user"], "replay": {
        "default": [QUESTIONS, {"say": "{{ last.answers.color }} {{ last.answers.tags|join('+') }} "
                                       "{{ last.answers.why }}"}]}})
    receipt = await sessions.receive_input(pool, scope, session.id, content="ask me")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    turn = await sessions.get_turn(pool, scope, receipt.turn_id)
    assert turn.pending == {"kind": "questions", "questions": [
        {"id": "color", "question": "Which color?", "options": ["red", "blue"],
         "multi_select": False, "allow_other": False},
        {"id": "tags", "question": "Which tags?", "options": ["a", "b", "c"],
         "multi_select": True, "allow_other": False},
        {"id": "why", "question": "Why?", "options": [], "multi_select": False,
         "allow_other": True}]}
    for bad, field in [({"color": "red", "tags": ["a"]}, "answers.why"),
                       ({"color": "green", "tags": ["a"], "why": "x"}, "answers.color"),
                       ({"color": ["red", "blue"], "tags": ["a"], "why": "x"}, "answers.color")]:
        with pytest.raises(InvalidRequest) as err:
            await sessions.answer_turn(pool, scope, receipt.turn_id, answers=bad)
        assert [e["field"] for e in err.value.errors] == [field]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE turn_id = %s",
                        (receipt.turn_id,)) == 1
    await sessions.answer_turn(pool, scope, receipt.turn_id,
                               answers={"color": "blue", "tags": ["a", "c"], "why": "because"})
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "blue a+c because"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).pending is None


async def test_cancel_while_waiting_for_the_user(pool, checkpoint_pool, alice):
    scope = alice[1]
    session, receipt = await _confirming(pool, checkpoint_pool, scope)
    turn = await sessions.cancel_turn(pool, scope, receipt.turn_id)
    assert turn.status == "cancelling"
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, receipt.turn_id)
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "cancelled"
    assert_paired(await conversation.messages(checkpoint_pool, session.id))
    assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 0
    # The session takes input again; it waits in the queue the cancel paused
    # (test_cancel_waiting_pauses.py) and starts on continue.
    nxt = await sessions.receive_input(pool, scope, session.id, content="again")
    assert nxt.status == "queued"
    await sessions.continue_queue(pool, scope, session.id)
    assert (await sessions.get_input(pool, scope, nxt.input_id)).status == "started"


async def test_a_failed_answer_leaves_the_turn_waiting_and_can_be_retried(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    session, receipt = await _confirming(pool, checkpoint_pool, scope)
    call_id = (await sessions.get_turn(pool, scope, receipt.turn_id)).pending["approvals"][0]["call_id"]
    async with pool.connection() as conn:
        src = (await (await conn.execute(
            "SELECT pg_get_functiondef('yuxi.resume_wait_v1'::regproc) AS d")).fetchone())["d"]
        # Test-only: the resume fails server-side.
        await conn.execute("""CREATE OR REPLACE FUNCTION yuxi.resume_wait_v1(p_wait uuid)
                              RETURNS uuid LANGUAGE plpgsql AS $$
                              BEGIN RAISE EXCEPTION 'boom'; END $$""")
    decision = [{"call_id": call_id, "approve": True}]
    with pytest.raises(Exception, match="boom"):
        await sessions.answer_turn(pool, scope, receipt.turn_id, decisions=decision)
    turn = await sessions.get_turn(pool, scope, receipt.turn_id)
    assert turn.status == "waiting_user" and turn.pending is not None
    async with pool.connection() as conn:
        await conn.execute(src)
    await sessions.answer_turn(pool, scope, receipt.turn_id, decisions=decision)
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, receipt.turn_id)).output["text"] == "noted"
