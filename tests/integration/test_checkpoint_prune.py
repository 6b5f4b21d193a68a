"""Checkpoint storage per turn stays flat: the run that completes its turn
prunes the thread's superseded checkpoints (yuxi.prune_checkpoints_v1 from
complete_run_v1), and nothing that resumes the thread is lost."""

from __future__ import annotations

from tests.integration.helpers import (
    drain, new_session, rewrite_function, scalar, say_agent,
)
from yuxi.runtime import cleanup
from yuxi.runtime import saver as saver_module
from yuxi.services import conversation, sessions

THREAD_BYTES = """
SELECT (SELECT coalesce(sum(pg_column_size(c.*)), 0) FROM langgraph.checkpoints c
         WHERE thread_id = %(t)s)
     + (SELECT coalesce(sum(pg_column_size(b.*)), 0) FROM langgraph.checkpoint_blobs b
         WHERE thread_id = %(t)s)
     + (SELECT coalesce(sum(pg_column_size(w.*)), 0) FROM langgraph.checkpoint_writes w
         WHERE thread_id = %(t)s)
"""


async def _bytes_per_turn(pool, checkpoint_pool, scope, turns: int, marks: tuple[int, ...]):
    """Checkpoint bytes of one session's thread after each turn in `marks`."""
    session = await new_session(pool, scope, say_agent("answer {{ input }} " + "x" * 600))
    sizes = {}
    for i in range(1, turns + 1):
        await sessions.receive_input(pool, scope, session.id, content=f"question {i} " + "y" * 100)
        assert await drain(pool, checkpoint_pool) == ["completed"]
        if i in marks:
            sizes[i] = await scalar(pool, THREAD_BYTES, {"t": str(session.id)})
    return session, sizes


def _growth(sizes):
    """Bytes per turn over (10, 20] and over (40, 50]."""
    return (sizes[20] - sizes[10]) / 10, (sizes[50] - sizes[40]) / 10


async def test_storage_per_turn_is_flat_and_history_is_whole(pool, checkpoint_pool, alice):
    session, sizes = await _bytes_per_turn(pool, checkpoint_pool, alice[1], 50, (10, 20, 40, 50))
    early, late = _growth(sizes)
    # Live checkpoint bytes: one turn's messages at most (earlier turns are
    # rows of yuxi.conversation), so they hardly change from turn to turn.
    assert abs(late) < 256 and abs(early) < 256, (sizes, early, late)
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints "
                              "WHERE thread_id = %s", (str(session.id),)) == 1
    history = await conversation.messages(checkpoint_pool, session.id)
    assert [m["content"].split()[1] for m in history if m["role"] == "human"] == \
        [str(i) for i in range(1, 51)]


async def test_without_the_prune_every_checkpoint_stays(pool, checkpoint_pool, alice):
    # Negative case: complete_run_v1 without its prune keeps every turn's
    # checkpoint. (Each holds one turn's messages since the earlier turns
    # moved to yuxi.conversation, and a turn writes only its last one, so the
    # growth is linear, not quadratic, but it is still more than the pruned
    # thread's one checkpoint.)
    await rewrite_function(pool, "yuxi.complete_run_v1",
                           "PERFORM yuxi.prune_checkpoints_v1(v_run.session_id::text);", "")
    session, sizes = await _bytes_per_turn(pool, checkpoint_pool, alice[1], 50,
                                           (10, 20, 40, 50))
    early, late = _growth(sizes)
    assert late >= 2048, sizes
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints "
                              "WHERE thread_id = %s", (str(session.id),)) == 50


CHECKPOINTS = "SELECT count(*) FROM langgraph.checkpoints WHERE thread_id = %s"


async def test_a_completion_that_does_not_commit_prunes_nothing(
        pool, checkpoint_pool, alice, monkeypatch):
    # Crash point: the prune is part of the completing transaction. A
    # completion that fails after it (here: raises) rolls it back, and every
    # checkpoint the turn's recovery would resume from is still there (the
    # model is slow: the turn's start was written during its call).
    monkeypatch.setattr(saver_module, "HOLD_SECONDS", 0)
    scope = alice[1]
    session = await new_session(pool, scope, say_agent(delay_ms=20))
    await sessions.receive_input(pool, scope, session.id, content="one")
    assert await drain(pool, checkpoint_pool) == ["completed"]
    assert await scalar(pool, CHECKPOINTS, (str(session.id),)) == 1
    await rewrite_function(
        pool, "yuxi.complete_run_v1",
        "PERFORM yuxi.prune_checkpoints_v1(v_run.session_id::text);",
        "PERFORM yuxi.prune_checkpoints_v1(v_run.session_id::text); "
        "RAISE EXCEPTION 'crash after the prune';")
    await sessions.receive_input(pool, scope, session.id, content="two")
    await drain(pool, checkpoint_pool)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE status = 'completed'") == 1
    assert await scalar(pool, CHECKPOINTS, (str(session.id),)) > 1
    history = await conversation.messages(checkpoint_pool, session.id)
    assert [m["content"] for m in history if m["role"] == "human"] == ["one", "two"]


async def test_a_waiting_turn_keeps_its_checkpoint_and_resumes(pool, checkpoint_pool, alice):
    # A wait's resume and a cancel's cleanup start from the thread's latest
    # checkpoint and its pending writes: a session whose earlier turns were
    # pruned still suspends on a question, is answered and completes; its
    # next turn suspends again, is cancelled and cleaned; the history is whole.
    from tests.integration.test_user_waits import QUESTIONS
    scope = alice[1]
    session = await new_session(pool, scope, {"model": "replay", "tools": ["ask_user"], "replay": {
        "default": [QUESTIONS, {"say": "{{ last.answers.color }}"}]}})
    answers = {"color": "blue", "tags": ["a"], "why": "because"}
    first = await sessions.receive_input(pool, scope, session.id, content="first")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    await sessions.answer_turn(pool, scope, first.turn_id, answers=answers)
    assert await drain(pool, checkpoint_pool) == ["completed"]
    assert await scalar(pool, CHECKPOINTS, (str(session.id),)) == 1
    second = await sessions.receive_input(pool, scope, session.id, content="second")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    await sessions.cancel_turn(pool, scope, second.turn_id)
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, second.turn_id)
    history = await conversation.messages(checkpoint_pool, session.id)
    assert [m["content"] for m in history if m["role"] == "human"] == ["first", "second"]
    assert [m["content"] for m in history if m["role"] == "ai" and m["content"]] == ["blue"]
