"""A worker that completes a turn goes on with its session's next queued turn:
the completing transaction leases the next run to it (no job, no queue round
trip), bounded per job; the hand-over is as durable as a job."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.helpers import (
    checkpoint_reads, events, executor, new_session, rewrite_function, rows, runs_with_status, scalar, say_agent)
from yuxi.runtime.saver import checkpoint_connection
from yuxi.services import runs, sessions


async def _jobs(pool) -> list[str]:
    """Run ids of the execute_run jobs deferred so far."""
    found = await rows(pool, "SELECT args->>'run_id' AS run_id FROM procrastinate.procrastinate_jobs "
                             "WHERE task_name = 'execute_run' ORDER BY id")
    return [r["run_id"] for r in found]


async def _queued(pool, scope, n: int):
    """A session with `n` queued inputs: the session, the receipts and the
    ready run of the first."""
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    receipts = [await sessions.receive_input(pool, scope, session.id, content=f"q{i}", mode="queue")
                for i in range(n)]
    (first,) = await runs_with_status(pool, "ready")
    return session, receipts, first


async def test_the_worker_goes_on_with_the_next_queued_turn_without_a_job(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 3)
    assert await _jobs(pool) == [str(first)]
    assert await executor(pool, checkpoint_pool).execute(first) == "completed"
    for i, receipt in enumerate(receipts):
        result = await sessions.get_result(pool, scope, receipt.turn_id)
        assert (result.status, result.output["text"]) == ("completed", f"answer to q{i}")
    # Three runs, one job: the next runs were leased in the completing transactions.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs") == 3
    assert await _jobs(pool) == [str(first)]
    # Each turn reports its whole life, whichever way its run was started.
    log = await events(pool, session.tree_id)
    for receipt in receipts:
        assert [e["type"] for e in log if e["turn_id"] == receipt.turn_id] == [
            "input.received", "turn.started", "run.started", "message", "run.completed",
            "turn.completed"]
    # The next turns' runs were created leased (start_turn_run_v1): their
    # run.started says so, first attempts on this worker's host.
    started = [e["data"] for e in log if e["type"] == "run.started"]
    assert [(d["attempt"], d.get("handed_over", False)) for d in started] == [
        (1, False), (1, True), (1, True)]
    assert len({d.get("host") for d in started}) == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims") == 0


async def test_without_hand_over_the_next_turn_gets_a_job(pool, checkpoint_pool, alice):
    # Negative case: with no continuation allowed, completing defers a job for
    # the next turn (as fail, cancel and recovery always do).
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 2)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(first) == "completed"
    (second,) = await runs_with_status(pool, "ready")
    assert await _jobs(pool) == [str(first), str(second)]


async def test_a_handed_over_turn_counts_toward_the_worker_that_goes_on(pool, alice):
    # The next turn's run is created leased to the completing worker, and it
    # is that worker's load (runs.claimer, pick_claimer_v1) from the start.
    session, _receipts, first = await _queued(pool, alice[1], 2)
    token = uuid.uuid4()
    assert await runs.start_run(pool, first, token, 30, claimer=77) is not None
    outcome, following = await runs.complete(pool, first, token, {"text": "a"},
                                             next_token=uuid.uuid4(), lease_seconds=30)
    assert outcome == "completed" and following["id"] != first
    assert await rows(pool, "SELECT status, claimer FROM yuxi.runs WHERE id = %s",
                      (following["id"],)) == [{"status": "running", "claimer": 77}]


async def test_continuation_is_bounded_per_job_while_the_process_is_full(pool, checkpoint_pool, alice):
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 4)
    assert await executor(pool, checkpoint_pool, continued_runs=1,
                          worker_concurrency=1).execute(first) == "completed"
    statuses = [(await sessions.get_turn(pool, scope, r.turn_id)).status for r in receipts]
    assert statuses == ["completed", "completed", "running", "queued"]
    (third,) = await runs_with_status(pool, "ready")
    assert await _jobs(pool) == [str(first), str(third)]  # the queue takes over


async def test_a_handed_over_run_whose_worker_died_is_recovered(pool, checkpoint_pool, alice):
    # The worker commits the hand-over and dies before executing the next run:
    # it is a leased run like any other, so lease expiry recovers it.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 2)
    token, next_token = uuid.uuid4(), uuid.uuid4()
    assert await runs.start_run(pool, first, token, 30) is not None
    outcome, following = await runs.complete(pool, first, token, {"text": "one"},
                                             next_token=next_token, lease_seconds=30)
    assert outcome == "completed"
    assert following["turn_id"] == receipts[1].turn_id and following["input_content"] == "q1"
    assert following["boundary_pending"] is False
    assert await rows(pool, "SELECT status, lease_token FROM yuxi.runs WHERE id = %s",
                      (following["id"],)) == [{"status": "running", "lease_token": next_token}]
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() - interval '1 s' "
                       "WHERE id = %s RETURNING id", (following["id"],))
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    assert retry == following["id"]
    (ready,) = await runs_with_status(pool, "ready")
    assert await _jobs(pool) == [str(first), str(ready)]
    await executor(pool, checkpoint_pool).execute(ready)
    result = await sessions.get_result(pool, scope, receipts[1].turn_id)
    assert (result.status, result.output["text"]) == ("completed", "answer to q1")


async def test_the_next_turn_never_jumps_the_tree_fifo(pool, checkpoint_pool, alice):
    # A member's run waiting for a slot is older than the next queued turn:
    # the freed slot is the member's (handed over to the completing worker),
    # and the session's next turn waits in the FIFO behind it.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 2)
    token, next_token = uuid.uuid4(), uuid.uuid4()
    assert await runs.start_run(pool, first, token, 30) is not None
    await scalar(pool, "UPDATE yuxi.trees SET slot_capacity = 1 WHERE id = %s RETURNING id",
                 (session.tree_id,))
    await scalar(pool, "SELECT yuxi.create_child_session_v1(%s, NULL, 'kid', NULL, NULL, '{}', "
                       "'task')", (session.id,))
    (member,) = await runs_with_status(pool, "pending")
    outcome, following = await runs.complete(pool, first, token, {"text": "one"},
                                             next_token=next_token, lease_seconds=30)
    assert (outcome, following["id"]) == ("completed", member)
    assert await _jobs(pool) == [str(first)]
    (waiting,) = await runs_with_status(pool, "pending")
    assert await scalar(pool, "SELECT turn_id FROM yuxi.runs WHERE id = %s",
                        (waiting,)) == receipts[1].turn_id


async def _marks(conn) -> tuple[str, str]:
    cur = await conn.execute("SELECT current_setting('yuxi.run_id', true) AS run, "
                             "current_setting('yuxi.lease_token', true) AS token")
    row = await cur.fetchone()
    return row["run"] or "", row["token"] or ""


async def test_start_and_hand_over_mark_the_checkpoint_connection(
        pool, checkpoint_pool, alice):
    # The lease and the checkpointer's fence mark commit together: the worker
    # needs no separate round trip, and the connection always carries the
    # lease of the run it writes for.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 2)
    token, next_token = uuid.uuid4(), uuid.uuid4()
    async with checkpoint_connection(checkpoint_pool) as conn:
        assert await _marks(conn) == ("", "")
        assert await runs.start_run(conn, first, token, 30, mark=True) is not None
        assert await _marks(conn) == (str(first), str(token))
        _, following = await runs.complete(conn, first, token, {"text": "one"}, mark=True,
                                           next_token=next_token, lease_seconds=30)
        assert await _marks(conn) == (str(following["id"]), str(next_token))
    async with checkpoint_pool.connection() as conn:
        assert await _marks(conn) == ("", "")  # handed back unmarked


async def test_without_mark_the_connection_keeps_no_lease(pool, checkpoint_pool, alice):
    # Negative case: a lease taken without `mark` leaves the connection as it
    # was; the fence triggers then see no run (see test_leases for what a
    # marked connection refuses).
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    async with checkpoint_connection(checkpoint_pool) as conn:
        assert await runs.start_run(conn, first, uuid.uuid4(), 30) is not None
        assert await _marks(conn) == ("", "")


async def test_a_broken_checkpoint_connection_is_dropped_without_an_error(
        pool, checkpoint_pool, alice):
    # A checkpoint write cancelled mid-query (a parallel tool call stopped by a
    # cancel) breaks the connection: handing it back must not raise over the
    # run's outcome, and it is never reused marked.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    async with checkpoint_connection(checkpoint_pool) as conn:
        assert await runs.start_run(conn, first, uuid.uuid4(), 30, mark=True) is not None
        await conn.close()
    async with checkpoint_connection(checkpoint_pool) as conn:
        assert await _marks(conn) == ("", "")


async def _all_unmarked(checkpoint_pool) -> None:
    conns = [await checkpoint_pool.getconn() for _ in range(checkpoint_pool.max_size)]
    try:
        for conn in conns:
            assert await _marks(conn) == ("", "")
            await conn.rollback()
    finally:
        for conn in conns:
            await checkpoint_pool.putconn(conn)


def _count_unmarks(monkeypatch) -> list[object]:
    from yuxi.runtime import executor as executor_module, saver as saver_module

    unmarked: list[object] = []
    original = saver_module.unmark

    async def counted(conn):
        unmarked.append(conn)
        await original(conn)

    for module in (executor_module, saver_module):
        monkeypatch.setattr(module, "unmark", counted)
    return unmarked


async def test_a_skipped_run_hands_its_connection_back_without_a_round_trip(
        pool, checkpoint_pool, alice, monkeypatch):
    # A run another worker took (a claim lost, a stale job) marked nothing:
    # its connection goes back as it came, with no unmarking statement.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    assert await runs.start_run(pool, first, uuid.uuid4(), 30) is not None  # taken
    unmarked = _count_unmarks(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(first) == "skipped"
    assert unmarked == []
    await _all_unmarked(checkpoint_pool)


async def test_a_lease_whose_answer_is_lost_never_leaves_its_connection_marked(
        pool, checkpoint_pool, alice, monkeypatch):
    # The lease (and the mark) committed, but the worker is cancelled before
    # it reads the answer: the connection is unmarked all the same.
    import asyncio

    from yuxi.runtime import executor as executor_module

    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    real_start = runs.start_run_reading

    async def committed_then_cancelled(*args, **kwargs):
        await real_start(*args, **kwargs)
        raise asyncio.CancelledError

    monkeypatch.setattr(executor_module.runs, "start_run_reading", committed_then_cancelled)
    with pytest.raises(asyncio.CancelledError):
        await executor(pool, checkpoint_pool).execute(first)
    await _all_unmarked(checkpoint_pool)


async def test_a_handed_over_turn_starts_from_the_checkpoint_its_worker_wrote(
        pool, checkpoint_pool, alice, monkeypatch):
    # The session's next turn, handed over by the completion: its run starts
    # from the checkpoint the same worker just committed (the lease left no
    # gap for another writer) and reads none; its conversation is whole.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 3)
    reads = checkpoint_reads(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(first) == "completed"
    assert reads == []
    from yuxi.services import conversation

    texts = [m["content"] for m in await conversation.messages(checkpoint_pool, session.id)]
    assert texts == ["q0", "answer to q0", "q1", "answer to q1", "q2", "answer to q2"]


async def test_without_the_carried_checkpoint_each_handed_over_turn_reads_it(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: no checkpoint carried over: one round trip per turn after
    # the first.
    from yuxi.runtime.saver import RunSaver

    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 3)
    monkeypatch.setattr(RunSaver, "latest_tuple", lambda self: None)
    reads = checkpoint_reads(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(first) == "completed"
    assert reads == [str(session.id)] * 2


async def test_a_completion_with_nothing_to_go_on_with_unmarks_as_it_commits(
        pool, checkpoint_pool, alice, monkeypatch):
    # complete_run_v1 unmarks the connection in its own transaction when no
    # run follows: the worker hands it back with no round trip of its own.
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    unmarked = _count_unmarks(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(first) == "completed"
    assert unmarked == []
    await _all_unmarked(checkpoint_pool)


async def test_without_the_completions_unmark_the_connection_would_go_back_marked(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: a completion that leaves the mark, and a worker that
    # trusts it did not, hand a marked connection back to the pool.
    await rewrite_function(pool, "yuxi.complete_run_v1",
                           "PERFORM yuxi.mark_checkpoint_connection_v1('', '');", "NULL;")
    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)
    assert await executor(pool, checkpoint_pool).execute(first) == "completed"
    with pytest.raises(AssertionError):
        await _all_unmarked(checkpoint_pool)


async def test_a_run_that_fails_is_unmarked_by_its_worker(pool, checkpoint_pool, alice,
                                                          monkeypatch):
    # Any other end (here a failure) leaves the mark to the worker's own
    # unmarking statement.
    from yuxi.runtime import executor as executor_module

    scope = alice[1]
    session, receipts, first = await _queued(pool, scope, 1)

    async def broken(*args, **kwargs):
        raise RuntimeError("the model broke")

    monkeypatch.setattr(executor_module, "drive", broken)
    unmarked = _count_unmarks(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(first) == "failed"
    assert len(unmarked) == 1
    await _all_unmarked(checkpoint_pool)
