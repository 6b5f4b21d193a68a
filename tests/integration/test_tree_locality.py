"""Every statement the hot path runs writes rows of one tree only (the plan
for Citus in docs/scale-out.md: tree_id is the distribution column). A probe
of statement-level triggers (tree_locality.sql) records any INSERT, UPDATE or
DELETE whose rows span two trees, while a multi-tree workload runs: fan-out
and waits, a waiter resumed from another tree, a cross-tree message, steer,
cancel, stop and continue, and every recovery sweep. Negative: a function
made to touch two trees' rows in one statement is caught."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from pathlib import Path

from tests.integration.helpers import (drain, executor, new_session, rewrite_function, rows,
                                       runs_with_status)
from tests.integration.test_cooperation import orchestrator
from yuxi.services import runs, sandbox, sessions

PROBE = Path(__file__).with_name("tree_locality.sql")


async def install_probe(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute(PROBE.read_text())


async def violations(pool) -> list[dict]:
    return await rows(pool, "SELECT table_name, operation, trees, query FROM yuxi_probe.cross_tree")


async def workload(pool, checkpoint_pool, scope, tmp_path) -> None:
    # Fan-out, waits and exact results in three trees at once.
    roots = [await new_session(pool, scope, orchestrator(children=3)) for _ in range(3)]
    for root in roots:
        await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    await drain(pool, checkpoint_pool)

    # A waiter resumed by a fact of another tree (through its job), and a
    # message sent across trees.
    other = await new_session(pool, scope)
    waiter = await new_session(pool, scope, {"model": "replay", "tools": ["cooperation"],
                                             "replay": {"default": [
        {"call": [{"tool": "wait_sessions", "args": {"sessions": [str(other.id)],
                                                     "timeout_s": 600}}]},
        {"call": [{"tool": "send_message", "args": {"session": str(other.id), "text": "hi"}}]},
        {"say": "done"}]}})
    await sessions.receive_input(pool, scope, waiter.id, content="wait")
    await drain(pool, checkpoint_pool)
    await sessions.receive_input(pool, scope, other.id, content="go")
    await drain(pool, checkpoint_pool)
    for wait in await rows(pool, "SELECT id FROM yuxi.waits WHERE status = 'satisfied' "
                                 "AND resume_run_id IS NULL"):
        await runs.resume_wait(pool, wait["id"])
    await drain(pool, checkpoint_pool)

    # Steer, queue, cancel, stop and continue.
    slow = await new_session(pool, scope, {"model": "replay", "replay": {"default": [
        {"say": "slow"}]}})
    first = await sessions.receive_input(pool, scope, slow.id, content="one")
    await sessions.receive_input(pool, scope, slow.id, content="steer")
    queued = await sessions.receive_input(pool, scope, slow.id, content="two", mode="queue")
    await sessions.receive_input(pool, scope, slow.id, content="three", mode="queue")
    await sessions.cancel_turn(pool, scope, queued.turn_id)
    await sessions.stop_tree(pool, scope, slow.id)
    await sessions.continue_queue(pool, scope, slow.id)
    await drain(pool, checkpoint_pool)
    assert first.turn_id

    # A run whose worker died, and every sweep.
    await sessions.receive_input(pool, scope, roots[0].id, content="again")
    (run_id,) = await runs_with_status(pool, "ready")
    await runs.start_run(pool, run_id, uuid.uuid4(), 0.01)
    await asyncio.sleep(0.05)
    assert await runs.recover_expired(pool, 3)
    await runs.redeliver_ready(pool, dt.timedelta(0))
    await runs.redeliver_waits(pool, dt.timedelta(0))
    await runs.redeliver_cleanups(pool, dt.timedelta(0))
    await runs.release_dead_hosts(pool, dt.timedelta(seconds=30))
    await sandbox.release_idle(pool, tmp_path)
    await drain(pool, checkpoint_pool)
    done = await rows(pool, "SELECT status, attempt FROM yuxi.runs WHERE status NOT IN "
                            "('completed', 'suspended', 'cancelled')")
    assert done == [{"status": "failed", "attempt": 1}], done  # the recovered one
    assert len(await rows(pool, "SELECT 1 FROM yuxi.messages")) == 1


async def test_hot_path_statements_write_one_tree(pool, checkpoint_pool, alice, tmp_path):
    await install_probe(pool)
    await workload(pool, checkpoint_pool, alice[1], tmp_path)
    trees = await rows(pool, "SELECT count(*) AS n FROM yuxi.trees")
    assert trees[0]["n"] >= 6  # the workload really spanned trees
    assert await violations(pool) == []


async def test_a_statement_touching_two_trees_is_caught(pool, checkpoint_pool, alice):
    # Negative: taking a lease also "touches" every completed run, of any tree.
    await rewrite_function(pool, "yuxi.start_run_v1",
                           "PERFORM yuxi.lock_tree_v1(v_run.tree_id);",
                           "PERFORM yuxi.lock_tree_v1(v_run.tree_id); "
                           "UPDATE yuxi.runs SET error = error WHERE status = 'completed';")
    await install_probe(pool)
    scope = alice[1]
    for _ in range(3):
        session = await new_session(pool, scope)
        await sessions.receive_input(pool, scope, session.id, content="x")
        (run_id,) = await runs_with_status(pool, "ready")
        await executor(pool, checkpoint_pool).execute(run_id)
    caught = await violations(pool)
    assert caught and {(v["table_name"], v["operation"]) for v in caught} == {("runs", "UPDATE")}
    assert "start_run_v1" in caught[0]["query"]
