"""Leases: a stale lease holder changes nothing; expired runs are recovered
into a new run of the same turn; lost jobs are re-delivered."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import psycopg
import pytest
from langchain_core.messages import HumanMessage

from tests.integration import gated
from tests.integration.helpers import (
    drain, fenced_saver, new_session, rows, runs_with_status, scalar, say_agent)
from yuxi.errors import LeaseLost
from yuxi.runtime import cleanup
from yuxi.services import runs, sessions


async def _running_run(pool, scope, config=None):
    session = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    assert await runs.start_run(pool, run_id, token, 30) is not None
    return session, receipt, run_id, token


async def _expire(pool, run_id):
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() - interval '1 s' "
                       "WHERE id = %s RETURNING id", (run_id,))


async def test_start_run_takes_a_ready_run_once(pool, alice):
    _, receipt, run_id, _ = await _running_run(pool, alice[1])
    assert await runs.start_run(pool, run_id, uuid.uuid4(), 30) is None  # duplicate job


async def test_holder_completes_but_a_wrong_token_cannot(pool, alice):
    _, receipt, run_id, token = await _running_run(pool, alice[1])
    with pytest.raises(LeaseLost):
        await runs.complete(pool, run_id, uuid.uuid4(), {"text": "forged"})
    with pytest.raises(LeaseLost):
        await runs.fail(pool, run_id, uuid.uuid4(), "forged")
    await runs.complete(pool, run_id, token, {"text": "real"})
    assert (await sessions.get_result(pool, alice[1], receipt.turn_id)).output == {"text": "real"}


async def test_stale_holder_after_recovery_changes_nothing(pool, alice):
    session, receipt, run_id, token = await _running_run(pool, alice[1])
    await _expire(pool, run_id)
    recovered = await runs.recover_expired(pool, max_attempts=3)
    assert recovered == [run_id]
    (new_run,) = await runs_with_status(pool, "ready")
    # The new run inherited the slot; the old one failed with the reason.
    assert await scalar(pool, "SELECT run_id FROM yuxi.slot_claims") == new_run
    old = (await rows(pool, "SELECT status, error FROM yuxi.runs WHERE id = %s", (run_id,)))[0]
    assert old["status"] == "failed" and "lease expired" in old["error"]
    before = await scalar(pool, "SELECT count(*) FROM yuxi.events")
    for attempt in (runs.complete(pool, run_id, token, {"text": "stale"}),
                    runs.fail(pool, run_id, token, "stale"),
                    runs.emit(pool, run_id, token, "message", {}, None)):
        with pytest.raises(LeaseLost):
            await attempt
    assert not await runs.heartbeat(pool, run_id, token, 30)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events") == before
    assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s",
                        (receipt.turn_id,)) == "running"


async def test_expired_but_unrecovered_lease_is_lost_too(pool, alice):
    _, _, run_id, token = await _running_run(pool, alice[1])
    await _expire(pool, run_id)
    with pytest.raises(LeaseLost):
        await runs.complete(pool, run_id, token, {"text": "late"})
    assert not await runs.heartbeat(pool, run_id, token, 30)


async def test_heartbeat_extends_a_held_lease(pool, alice):
    _, _, run_id, token = await _running_run(pool, alice[1])
    before = await scalar(pool, "SELECT lease_expires_at FROM yuxi.runs WHERE id = %s", (run_id,))
    assert await runs.heartbeat(pool, run_id, token, 60)
    after = await scalar(pool, "SELECT lease_expires_at FROM yuxi.runs WHERE id = %s", (run_id,))
    assert after > before


async def test_checkpoint_writes_are_fenced_by_the_lease(pool, checkpoint_pool, alice):
    session, _, run_id, token = await _running_run(pool, alice[1])
    cfg = {"configurable": {"thread_id": str(session.id), "checkpoint_ns": ""}}
    from tests.integration.helpers import executor as _  # noqa: F401  (import check)
    from yuxi.runtime.graph import build_graph
    from yuxi.runtime.models import build_chat_model

    class Quiet:
        async def message(self, m): ...
        async def tool_started(self, c): ...
        async def tool_finished(self, c, r): ...

    async def invoke(tok):
        model = build_chat_model("replay", say_agent(), approval_mode="auto", session={})
        async with fenced_saver(checkpoint_pool, run_id, tok) as saver:
            graph = build_graph(model, {}, Quiet(), preamble=[], checkpointer=saver)
            await graph.ainvoke({"messages": [HumanMessage("x", id="h1")]}, cfg)

    with pytest.raises(psycopg.Error) as err:
        await invoke(uuid.uuid4())
    assert err.value.sqlstate == "YX003"
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints") == 0
    # A connection returned to the pool is unmarked: plain writes go through.
    async with checkpoint_pool.connection() as conn:
        mark = await (await conn.execute(
            "SELECT current_setting('yuxi.run_id', true) AS r")).fetchone()
        assert mark["r"] == ""
    await invoke(token)
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints") > 0


async def test_recovery_gives_up_after_max_attempts(pool, checkpoint_pool, alice):
    session, receipt, run_id, _ = await _running_run(pool, alice[1])
    for _ in range(2):
        await _expire(pool, run_id)
        await runs.recover_expired(pool, max_attempts=2)
        ready = await runs_with_status(pool, "ready")
        if not ready:
            break
        run_id = ready[0]
        assert await runs.start_run(pool, run_id, uuid.uuid4(), 30)
    turn = (await rows(pool, "SELECT status, error, result_run_id FROM yuxi.turns WHERE id = %s",
                       (receipt.turn_id,)))[0]
    assert turn["status"] == "failed" and "gave up after 2 attempts" in turn["error"]
    assert turn["result_run_id"] == run_id
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims") == 0


async def test_recovered_turn_continues_from_its_checkpoint(pool, checkpoint_pool, alice):
    # Guard: drive() continues a checkpoint with a next step (`state.next`:
    # the model after the tool step) with ainvoke(None), never by restarting
    # the turn or taking the last AI message of an unfinished graph as the
    # answer. The first run dies mid-graph: after its tool step is
    # checkpointed, during the next model call.
    config = {"model": "gated", "tools": ["echo"], "replay": {"default": [
        {"call": [{"tool": "echo", "args": {"text": "once"}}]}, {"say": "done {{ results|length }}"}]}}
    with gated.gated_model() as gate:
        session, receipt, first = await gated.start_run(pool, checkpoint_pool, alice[1], config)
        await gate.calls.get()
        (run_id,) = await runs_with_status(pool, "running")
        gate.pass_waiting()  # the tool call; the model's next call waits
        await gate.calls.get()
        first.cancel()  # the worker dies: its run stays running under its lease
        await asyncio.gather(first, return_exceptions=True)
        state = await cleanup.checkpoint_only_graph(checkpoint_pool).aget_state(
            {"configurable": {"thread_id": str(session.id)}})
        assert state.next == ("model",) and state.values["messages"][-1].type == "tool"
        await _expire(pool, run_id)
        assert await runs.recover_expired(pool, max_attempts=3) == [run_id]
        gate.opened.set()
        assert await drain(pool, checkpoint_pool) == ["completed"]
    result = await sessions.get_result(pool, alice[1], receipt.turn_id)
    assert result.output["text"] == "done 1"
    # One message event per AI message (the final answer's reported by the
    # recovered run's completion) and one tool execution: nothing repeated.
    counts = await rows(pool, """SELECT type, count(*) AS n FROM yuxi.events
                                 WHERE type IN ('message', 'tool.started') GROUP BY type ORDER BY type""")
    assert counts == [{"type": "message", "n": 2}, {"type": "tool.started", "n": 1}]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE turn_id = %s",
                        (receipt.turn_id,)) == 2


async def test_lost_job_of_a_ready_run_is_redelivered(pool, alice):
    session = await new_session(pool, alice[1])
    await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await runs.redeliver_ready(pool, dt.timedelta(0)) == []  # its job is there
    async with pool.connection() as conn, conn.transaction():
        # Procrastinate's triggers use unqualified names: its schema must lead.
        await conn.execute("SET LOCAL search_path = procrastinate")
        await conn.execute("DELETE FROM procrastinate_jobs")
    assert await runs.redeliver_ready(pool, dt.timedelta(hours=1)) == []  # too young
    assert await runs.redeliver_ready(pool, dt.timedelta(0)) == [run_id]
    assert await scalar(pool, "SELECT args->>'run_id' FROM procrastinate.procrastinate_jobs "
                              "WHERE status = 'todo'") == str(run_id)


async def test_without_the_checkpoint_fence_a_stale_worker_writes(pool, checkpoint_pool, alice):
    # Negative case: with the fence triggers gone, a checkpointer marked with
    # a lost lease writes its checkpoint anyway.
    session, _, run_id, token = await _running_run(pool, alice[1])
    async with pool.connection() as conn:
        for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
            await conn.execute(f"DROP TRIGGER {table}_fence ON langgraph.{table}")
    from yuxi.runtime.graph import build_graph
    from yuxi.runtime.models import build_chat_model

    class Quiet:
        async def message(self, m): ...
        async def tool_started(self, c): ...
        async def tool_finished(self, c, r): ...

    cfg = {"configurable": {"thread_id": str(session.id), "checkpoint_ns": ""}}
    model = build_chat_model("replay", say_agent(), approval_mode="auto", session={})
    async with fenced_saver(checkpoint_pool, run_id, uuid.uuid4()) as saver:
        graph = build_graph(model, {}, Quiet(), preamble=[], checkpointer=saver)
        await graph.ainvoke({"messages": [HumanMessage("x", id="h1")]}, cfg)
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints") > 0


SLOW_READ = ("SELECT pg_sleep(0.4)", None)


async def _tree_lock_taken_meanwhile(db_url, tree_id, pipeline) -> bool:
    """Whether another connection takes the tree's lock (waiting at most
    150 ms) while `pipeline` (a coroutine) is 100 ms in."""
    task = asyncio.ensure_future(pipeline)
    await asyncio.sleep(0.1)
    try:
        async with await psycopg.AsyncConnection.connect(db_url) as other:
            await other.execute("SET lock_timeout = '150ms'")
            try:
                await other.execute("SELECT yuxi.lock_tree_v1(%s)", (tree_id,))
                return True
            except psycopg.errors.LockNotAvailable:
                return False
    finally:
        await task


async def test_a_leases_first_reads_hold_no_tree_lock(db_url, pool, checkpoint_pool, alice):
    # The lease takes the tree's lock until its pipeline commits, and the
    # tree's claims, completions and events queue for it: the run's first
    # reads go before the lease in the pipeline, so a slow read holds up
    # no one.
    session = await new_session(pool, alice[1])
    await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    async with checkpoint_pool.connection() as conn:
        lease = runs.start_run_reading(conn, run_id, uuid.uuid4(), 30, [SLOW_READ])
        assert await _tree_lock_taken_meanwhile(db_url, session.tree_id, lease)
    assert await runs_with_status(pool, "running") == [run_id]


async def test_a_read_after_the_lease_holds_the_tree_lock(db_url, pool, checkpoint_pool, alice):
    # Negative case: the same read after the lease, in its pipeline (its
    # implicit transaction), keeps the tree locked while it runs.
    session = await new_session(pool, alice[1])
    await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")

    async def lease_then_read(conn):
        async with conn.pipeline():
            await conn.execute("SELECT * FROM yuxi.start_run_v1(%s, %s, 30)",
                               (run_id, uuid.uuid4()))
            await conn.execute(*SLOW_READ)

    async with checkpoint_pool.connection() as conn:
        assert not await _tree_lock_taken_meanwhile(db_url, session.tree_id,
                                                    lease_then_read(conn))
