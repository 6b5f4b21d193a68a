"""A connection-level error inside a run is an infrastructure fault, not a
failure of the turn (issue 12): the worker leaves the run to its lease and
marks it (fenced); recovery continues the turn from its last checkpoint in a
new run without using up YUXI_MAX_RUN_ATTEMPTS; infrastructure retries have
their own bound, so a permanently broken run still ends with a clear error.

The faults are real: every backend of the executor's own connections (an
application_name of its own, in this test's database only) is terminated
with pg_terminate_backend while the run is in flight (57P01)."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from tests.integration.helpers import drain, new_session, rows, runs_with_status, scalar
from yuxi import db
from yuxi.errors import is_connection_error
from yuxi.runtime.executor import RunExecutor
from yuxi.services import runs, sessions
from yuxi.settings import Settings

APP_NAME = "yuxi-infra-test-worker"

SCRIPT = {"default": [
    {"call": [{"tool": "echo", "args": {"text": "echo of {{ input }}"}}]},
    # The connections are terminated while this step "thinks".
    {"say": "final: {{ last.text }}", "delay_ms": 1500},
]}


@pytest.fixture
async def worker_pools(db_url):
    url = psycopg.conninfo.make_conninfo(db_url, application_name=APP_NAME)
    pool, checkpoints = db.app_pool(url), db.checkpoint_pool(url)
    await pool.open(wait=True)
    await checkpoints.open(wait=True)
    yield pool, checkpoints
    await checkpoints.close()
    await pool.close()


async def _terminate_worker_backends(pool) -> int:
    return len(await rows(pool, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND application_name = %s",
                          (APP_NAME,)))


async def _cut_off_run(pool, worker_pools, scope):
    """Start a turn, execute its run in the 'worker', and terminate the
    worker's backends mid-run. Returns (turn id, run id, outcome)."""
    session = await new_session(pool, scope, {"model": "replay", "replay": SCRIPT,
                                              "tools": ["echo"]})
    receipt = await sessions.receive_input(pool, scope, session.id, content="hi", mode="queue",
                                           by_user=True)
    (run_id,) = await runs_with_status(pool, "ready")
    ex = RunExecutor(Settings(lease_seconds=30), *worker_pools)
    task = asyncio.create_task(ex.execute(run_id))
    for _ in range(100):
        if await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'tool.finished'"):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # inside the model's 1.5 s step
    assert await _terminate_worker_backends(pool) > 0
    outcome = await asyncio.wait_for(task, 30)
    return receipt.turn_id, run_id, outcome


async def test_a_terminated_connection_does_not_fail_the_turn(pool, checkpoint_pool,
                                                              worker_pools, alice):
    turn_id, run_id, outcome = await _cut_off_run(pool, worker_pools, alice[1])
    assert outcome == "infra_fault"
    run = (await rows(pool, "SELECT status, infra_error, error, lease_expires_at <= "
                            "clock_timestamp() AS expired FROM yuxi.runs WHERE id = %s",
                      (run_id,)))[0]
    # Left to its lease (expired at once), marked, not failed.
    assert run["status"] == "running" and run["error"] is None and run["expired"], run
    assert "AdminShutdown" in run["infra_error"] or "terminat" in run["infra_error"], run
    assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s",
                        (turn_id,)) == "running"

    # max_attempts=1: a lost lease of a crash would fail the turn now; an
    # infrastructure fault is retried all the same.
    assert await runs.recover_expired(pool, max_attempts=1, max_infra_retries=5) == [run_id]
    await drain(pool, checkpoint_pool)
    turn_runs = await rows(pool, "SELECT attempt, infra_retries, status, error FROM yuxi.runs "
                                 "WHERE turn_id = %s ORDER BY slot_seq", (turn_id,))
    assert [(r["attempt"], r["infra_retries"], r["status"]) for r in turn_runs] == [
        (1, 0, "failed"), (2, 1, "completed")], turn_runs
    assert "infrastructure retry 1 of 5" in turn_runs[0]["error"]
    result = await sessions.get_result(pool, alice[1], turn_id)
    assert result.status == "completed" and result.output["text"] == "final: echo of hi"
    # The tool ran once: the retry continued from the checkpoint.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'tool.started' "
                              "AND turn_id = %s", (turn_id,)) == 1


async def test_infrastructure_retries_have_their_own_bound(pool, worker_pools, alice):
    turn_id, run_id, outcome = await _cut_off_run(pool, worker_pools, alice[1])
    assert outcome == "infra_fault"
    assert await runs.recover_expired(pool, max_attempts=3, max_infra_retries=0) == [run_id]
    turn = (await rows(pool, "SELECT status, error FROM yuxi.turns WHERE id = %s",
                       (turn_id,)))[0]
    assert turn["status"] == "failed"
    assert turn["error"].startswith("gave up after 0 infrastructure retries: database "
                                    "connection lost"), turn


async def test_a_lost_lease_without_a_report_uses_up_an_attempt(pool, alice):
    """The negative: a run whose worker vanished without a report (a crash)
    fails its turn at max_attempts=1; only a reported connection fault (or a
    server restart during the run) is an infrastructure retry."""
    session = await new_session(pool, alice[1])
    receipt = await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await runs.start_run(pool, run_id, uuid.uuid4(), 30) is not None
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() "
                       "- interval '1 s' WHERE id = %s RETURNING id", (run_id,))
    await runs.recover_expired(pool, max_attempts=1, max_infra_retries=5)
    turn = (await rows(pool, "SELECT status, error FROM yuxi.turns WHERE id = %s",
                       (receipt.turn_id,)))[0]
    assert turn["status"] == "failed" and "gave up after 1 attempts" in turn["error"], turn


async def test_report_is_fenced_by_the_lease_token(pool, alice):
    session = await new_session(pool, alice[1])
    await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    assert await runs.start_run(pool, run_id, token, 30) is not None
    assert await runs.report_infra_fault(pool, run_id, uuid.uuid4(), "x") is False
    assert await scalar(pool, "SELECT infra_error FROM yuxi.runs WHERE id = %s",
                        (run_id,)) is None
    assert await runs.report_infra_fault(pool, run_id, token, "x") is True


@pytest.mark.parametrize("exc,expected", [
    (psycopg.OperationalError("consuming input failed: server closed the connection "
                              "unexpectedly"), True),
    (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
    (psycopg.errors.ConnectionFailure("x"), True),
    (psycopg.errors.SerializationFailure("x"), False),
    (psycopg.errors.UniqueViolation("x"), False),
    (ValueError("x"), False),
])
def test_connection_errors_are_recognized(exc, expected):
    assert is_connection_error(exc) is expected


class _CutSaver:
    """LangGraph's Postgres saver whose connection is "cut" at its second
    checkpoint write: the first step's task writes are saved, its checkpoint
    is not (what a database restart between the two does)."""

    @staticmethod
    def make(conn):
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        class Cut(AsyncPostgresSaver):
            puts = 0

            async def aput(self, *args, **kwargs):
                Cut.puts += 1
                if Cut.puts == 2:
                    raise psycopg.OperationalError("consuming input failed: server closed "
                                                   "the connection unexpectedly")
                return await super().aput(*args, **kwargs)

        return Cut(conn)


async def test_a_run_cut_between_a_steps_writes_and_its_checkpoint_goes_on(
        pool, checkpoint_pool, alice):
    """The retry must not take the live view of saved task writes (here: the
    input, with no step checkpoint after it) for the end of the turn."""
    from tests.integration.helpers import executor, fenced_saver, say_agent
    from yuxi.runtime.executor import TurnConversation, drive

    session = await new_session(pool, alice[1], say_agent())
    await sessions.receive_input(pool, alice[1], session.id, content="hi")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 30)
    ex = executor(pool, checkpoint_pool)
    async with fenced_saver(checkpoint_pool, run_id, token) as saver:
        graph, cfg = ex._graph(run, token, _CutSaver.make(saver.conn))
        with pytest.raises(psycopg.OperationalError):
            await drive(graph, cfg, run, conv=TurnConversation(saver.conn, run, token))
        retry = {**run, "attempt": 2}
        graph, cfg = ex._graph(retry, token, saver)
        state = await graph.aget_state(cfg)
        assert not state.next and state.tasks, state  # the situation under test
        answer, _ = await drive(graph, cfg, retry,
                                conv=TurnConversation(saver.conn, retry, token))
    assert answer.text == "echo: hi"
