"""Permissions at the execution boundary: snapshots hold only a selection
intent; a run resolves visibility with the grants current when it starts;
a side-effecting tool checks its grant again when it executes."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration import gated
from tests.integration.helpers import (
    drain, executor, new_session, rows, runs_with_status, scalar, rewrite_function,
)
from yuxi.errors import InvalidRequest
from yuxi.services import accounts, conversation, resources, sessions

NOTES = ["collection:docs", "tool_group:notes"]


def notes_agent(model="replay", *steps, selection=NOTES) -> dict:
    return {"model": model, "tools": ["add_note", "search_notes"], "resources": selection,
            "replay": {"default": list(steps)}}


ADD = {"call": [{"tool": "add_note", "args": {"collection": "docs", "text": "{{ input }}"}}]}
REPORT = {"say": "{{ last.error.code if last.error is defined else 'noted ' ~ last.collection }}"}


async def _grant_all(pool, scope):
    for ref in NOTES:
        await resources.create(pool, scope.app_id, ref)
        await resources.grant(pool, scope, ref)


async def test_granted_run_writes_and_reads_its_collection(pool, checkpoint_pool, alice):
    scope = alice[1]
    await _grant_all(pool, scope)
    search = {"call": [{"tool": "search_notes", "args": {"collection": "docs", "query": "hel"}}]}
    session = await new_session(pool, scope, notes_agent(
        "replay", ADD, search, {"say": "{{ last.notes|join(',') }}"}))
    receipt = await sessions.receive_input(pool, scope, session.id, content="hello")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, receipt.turn_id)).output["text"] == "hello"
    assert await rows(pool, "SELECT content FROM yuxi.notes") == [{"content": "hello"}]
    # The snapshot holds the intent, never ids or grants.
    config = await scalar(pool, "SELECT config FROM yuxi.sessions WHERE id = %s", (session.id,))
    assert config["resources"] == NOTES


async def test_queued_input_after_revocation_fails_without_a_model_call(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    await _grant_all(pool, scope)
    session = await new_session(pool, scope, notes_agent("replay", ADD, REPORT))
    first = await sessions.receive_input(pool, scope, session.id, content="one", mode="queue")
    queued = await sessions.receive_input(pool, scope, session.id, content="two", mode="queue")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(run_id) == "completed"
    assert (await sessions.get_result(pool, scope, first.turn_id)).output["text"] == "noted docs"
    messages_before = await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'message'")
    await resources.revoke(pool, scope, "collection:docs")
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, queued.turn_id)
    assert result.status == "failed"
    assert result.error == "permission_denied: permission denied: no grant for collection:docs"
    # No model call for the queued input: no message, nothing new in the conversation.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'message'") == \
        messages_before
    history = await conversation.messages(checkpoint_pool, session.id)
    assert [m["content"] for m in history if m["role"] == "human"] == ["one"]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 1


async def _revoke_during_model_call(pool, checkpoint_pool, scope):
    """Grants hold when the run starts; the collection's grant is revoked while
    the model is producing the add_note call."""
    await _grant_all(pool, scope)
    with gated.gated_model() as gate:
        session = await new_session(pool, scope, notes_agent("gated", ADD, REPORT))
        receipt = await sessions.receive_input(pool, scope, session.id, content="x")
        (run_id,) = await runs_with_status(pool, "ready")
        task = asyncio.create_task(executor(pool, checkpoint_pool).execute(run_id))
        await gate.calls.get()
        await resources.revoke(pool, scope, "collection:docs")
        gate.opened.set()
        assert await task == "completed"
    return await sessions.get_result(pool, scope, receipt.turn_id)


async def test_side_effecting_tool_checks_the_grant_when_it_executes(pool, checkpoint_pool, alice):
    result = await _revoke_during_model_call(pool, checkpoint_pool, alice[1])
    # The run went on: the model got a structured error and reported it.
    assert result.output["text"] == "permission_denied"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 0


async def test_without_the_execution_check_the_revoked_write_happens(pool, checkpoint_pool, alice):
    # Negative case: the same interleaving with add_note_v1 not re-checking
    # the collection's grant writes the note after revocation.
    await rewrite_function(
        pool, "yuxi.add_note_v1",
        "v_resource := yuxi.check_grant_v1(v_run.user_id, v_run.app_id, 'collection', p_collection);",
        "SELECT id INTO v_resource FROM yuxi.resources "
        "WHERE kind = 'collection' AND name = p_collection;")
    result = await _revoke_during_model_call(pool, checkpoint_pool, alice[1])
    assert result.output["text"] == "noted docs"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.notes") == 1


async def test_all_accessible_resolves_to_current_grants(pool, checkpoint_pool, alice, mallory):
    scope = alice[1]
    await _grant_all(pool, scope)
    await resources.create(pool, scope.app_id, "collection:secret")  # granted to nobody
    visible = await resources.resolve(pool, scope.user_id, scope.app_id, "all")
    assert sorted(r.ref for r in visible) == NOTES
    assert await resources.resolve(pool, mallory[1].user_id, mallory[1].app_id, "all") == []
    await resources.revoke(pool, scope, "tool_group:notes")
    visible = await resources.resolve(pool, scope.user_id, scope.app_id, "all")
    assert [r.ref for r in visible] == ["collection:docs"]
    # A run with "all" starts fine; the notes tools are simply not available.
    session = await new_session(pool, scope, notes_agent("replay", ADD, REPORT, selection="all"))
    receipt = await sessions.receive_input(pool, scope, session.id, content="x")
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "completed" and result.output["text"] == "unknown_tool"


@pytest.mark.parametrize("selection", ["some", ["docs"], ["secret:docs"], [1], ["collection:a b"]])
async def test_bad_selection_is_refused(pool, alice, selection):
    with pytest.raises(InvalidRequest):
        await accounts.create_agent(pool, alice[1], "bad", {"resources": selection})
    assert await scalar(pool, "SELECT count(*) FROM yuxi.agents") == 0


async def test_resume_after_revocation_cannot_use_the_revoked_resource(
        pool, checkpoint_pool, alice):
    # The parent waits on a child; meanwhile its resource is revoked. The
    # resume run re-resolves grants when it starts and fails before any model
    # call: it cannot go on to create more work with the revoked resource.
    scope = alice[1]
    await _grant_all(pool, scope)
    config = notes_agent("replay",
                         {"call": [{"tool": "create_session", "args": {"name": "c", "task": "t"}}]},
                         {"call": [{"tool": "wait_sessions", "args": {"sessions": ["c"]}}]},
                         {"call": [{"tool": "create_session", "args": {"name": "d", "task": "t"}}]},
                         {"say": "went on"})
    config["tools"] = ["cooperation", "add_note"]
    config["replay"]["rules"] = [{"match": "^t$", "steps": [{"say": "child"}]}]
    session = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, session.id, content="parent")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "suspended"
    await resources.revoke(pool, scope, "collection:docs")
    await drain(pool, checkpoint_pool)  # the child (it fails too: it inherited the intent)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "failed" and "no grant for collection:docs" in result.error
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE name = 'd'") == 0
