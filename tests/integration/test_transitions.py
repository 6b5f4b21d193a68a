"""Every transition is refused from a state that does not allow it, with a
custom SQLSTATE that Python maps to a domain error."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from tests.integration.helpers import rewrite_function_sync
from tests.integration.test_slots import NEW_PENDING_RUN, make_tree
from yuxi import db
from yuxi.errors import IllegalTransition, LeaseLost, NotFound

RUN_STATES = ["pending", "ready", "running", "completed", "suspended", "failed", "cancelled"]


def _run_in_state(conn, status: str) -> tuple[uuid.UUID, uuid.UUID]:
    _, (session,) = make_tree(conn, 1)
    run = conn.execute(NEW_PENDING_RUN, {"session": session}).fetchone()[0]
    token = uuid.uuid4()
    ended = status in ("completed", "suspended", "failed", "cancelled")
    conn.execute(
        """UPDATE yuxi.runs SET status = %s, lease_token = %s,
               lease_expires_at = now() + interval '1 minute',
               finished_at = CASE WHEN %s THEN now() END,
               error = CASE WHEN %s = 'failed' THEN 'x' END
           WHERE id = %s""", (status, token, ended, status, run))
    return run, token


def _sqlstate(conn, sql: str, params) -> str | None:
    conn.execute("SAVEPOINT t")
    try:
        conn.execute(sql, params)
    except psycopg.Error as exc:
        conn.execute("ROLLBACK TO SAVEPOINT t")
        return exc.sqlstate
    conn.execute("RELEASE SAVEPOINT t")
    return None


END_RUN = {"complete": "SELECT yuxi.complete_run_v1(%s, %s, '{}')",
           "fail": "SELECT yuxi.fail_run_v1(%s, %s, 'boom')"}


@pytest.mark.parametrize("status", RUN_STATES)
def test_only_a_running_run_can_be_completed_or_failed(postgresql, status):
    # Guard: fence_run_v1, the start of both, refuses a run not `running`
    # (YX003) even with its lease token and an unexpired lease.
    for end, ended in (("complete", "completed"), ("fail", "failed")):
        run, token = _run_in_state(postgresql, status)
        expected = None if status == "running" else "YX003"
        assert _sqlstate(postgresql, END_RUN[end], (run, token)) == expected, end
        assert postgresql.execute("SELECT status FROM yuxi.runs WHERE id = %s", (run,)).fetchone()[0] \
            == (ended if status == "running" else status)


def test_without_the_status_check_a_finished_run_is_ended_again(postgresql):
    # Negative case: fence_run_v1 without its status condition lets the lease
    # holder of a run that already completed end it once more.
    rewrite_function_sync(postgresql, "yuxi.fence_run_v1", "v_run.status <> 'running' OR ", "")
    for end in END_RUN:
        run, token = _run_in_state(postgresql, "completed")
        assert _sqlstate(postgresql, END_RUN[end], (run, token)) is None, end


@pytest.mark.parametrize("status", RUN_STATES)
def test_only_a_ready_run_can_be_started(postgresql, status):
    run, _ = _run_in_state(postgresql, status)
    row = postgresql.execute("SELECT (yuxi.start_run_v1(%s, %s, 30)).id", (run, uuid.uuid4())).fetchone()
    assert (row[0] is not None) == (status == "ready")


@pytest.mark.parametrize("status", RUN_STATES)
def test_only_a_pending_run_can_claim_a_slot(postgresql, status):
    run, _ = _run_in_state(postgresql, status)
    expected = None if status == "pending" else "YX001"
    assert _sqlstate(postgresql, "SELECT yuxi.claim_slot_v1(%s)", (run,)) == expected


@pytest.mark.parametrize("turn_status", ["queued", "completed", "failed", "cancelled"])
def test_a_turn_not_in_flight_cannot_be_finished(postgresql, turn_status):
    run, _ = _run_in_state(postgresql, "completed")
    postgresql.execute(
        """UPDATE yuxi.turns SET status = %s,
               finished_at = CASE WHEN %s <> 'queued' THEN now() END,
               result_run_id = CASE WHEN %s IN ('completed', 'failed') THEN %s::uuid END
           WHERE id = (SELECT turn_id FROM yuxi.runs WHERE id = %s)""",
        (turn_status, turn_status, turn_status, run, run))
    assert _sqlstate(postgresql, "SELECT yuxi.finish_turn_v1(%s, 'completed', NULL)",
                     (run,)) == "YX001"


async def test_sqlstates_map_to_domain_errors(pool):
    async with pool.connection() as conn:
        for sql, error in [
            ("SELECT yuxi.lock_tree_v1(gen_random_uuid())", NotFound),
            ("SELECT yuxi.complete_run_v1(%s, gen_random_uuid(), '{}')", NotFound),
        ]:
            with pytest.raises(error):
                with db.domain_errors():
                    await conn.execute(sql, (uuid.uuid4(),) if "%s" in sql else None)
    for code, error in [("YX001", IllegalTransition), ("YX003", LeaseLost)]:
        async with pool.connection() as conn:
            with pytest.raises(error):
                with db.domain_errors():
                    await conn.execute(
                        f"DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = '{code}'; END $$")
