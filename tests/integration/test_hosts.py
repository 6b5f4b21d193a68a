"""Worker hosts and sandbox affinity (sql/120_hosts.sql): a tree whose
sandbox is live on a host runs on that host's queue; another host cannot
claim it (the run is handed over); a host whose heartbeat expired releases
its sandboxes and its queued runs move to the shared queue; a host's idle
sweep releases only its own sandboxes. Each guard has its negative case."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from tests.integration.helpers import new_session, rewrite_function, rows, runs_with_status, scalar
from yuxi.errors import SandboxElsewhere
from yuxi.services import runs, sandbox, sessions

TIMEOUT = dt.timedelta(seconds=30)


async def _leased_run(pool, scope, host: str | None, session=None):
    session = session or await new_session(pool, scope)
    await sessions.receive_input(pool, scope, session.id, content="x")
    (run_id,) = await runs_with_status(pool, "ready", session.tree_id)
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 60, host=host)
    return session, run, token


async def _job_queues(pool, run_id) -> list[str]:
    return [r["queue_name"] for r in await rows(
        pool, "SELECT queue_name FROM procrastinate.procrastinate_jobs "
              "WHERE task_name = 'execute_run' AND args->>'run_id' = %s ORDER BY id",
        (str(run_id),))]


async def _sandbox_on(pool, scope, tmp_path, host: str):
    """A tree whose sandbox went live on `host` (its run then completed)."""
    session, run, token = await _leased_run(pool, scope, host)
    await sandbox.claim(pool, tmp_path, run["id"], token, run["tree_id"], host=host)
    await runs.complete(pool, run["id"], token, {"text": "done"})
    return session


async def test_runs_of_a_tree_with_a_live_sandbox_go_to_its_host_queue(pool, alice, tmp_path):
    scope = alice[1]
    session = await _sandbox_on(pool, scope, tmp_path, "host-a")
    assert await scalar(pool, "SELECT host_id FROM yuxi.sandboxes WHERE tree_id = %s",
                        (session.tree_id,)) == "host-a"
    await sessions.receive_input(pool, scope, session.id, content="next")
    (run_id,) = await runs_with_status(pool, "ready", session.tree_id)
    assert await _job_queues(pool, run_id) == ["runs@host-a"]
    # A tree without a live sandbox runs anywhere.
    other = await new_session(pool, scope)
    await sessions.receive_input(pool, scope, other.id, content="x")
    (free_run,) = await runs_with_status(pool, "ready", other.tree_id)
    assert await _job_queues(pool, free_run) == ["runs"]


async def test_without_routing_the_run_would_go_anywhere(pool, alice, tmp_path):
    # Negative: the queue choice removed from the deferral.
    await rewrite_function(pool, "yuxi.run_queue_v1", "RETURN coalesce('runs@' || v_host, 'runs')",
                           "RETURN 'runs'")
    session = await _sandbox_on(pool, alice[1], tmp_path, "host-a")
    await sessions.receive_input(pool, alice[1], session.id, content="next")
    (run_id,) = await runs_with_status(pool, "ready", session.tree_id)
    assert await _job_queues(pool, run_id) == ["runs"]


async def test_another_host_cannot_claim_a_live_sandbox_and_hands_the_run_over(
        pool, alice, tmp_path):
    scope = alice[1]
    session = await _sandbox_on(pool, scope, tmp_path, "host-a")
    # A run that reached host-b anyway (deferred before the sandbox went live).
    _, run, token = await _leased_run(pool, scope, "host-b", session)
    with pytest.raises(SandboxElsewhere):
        await sandbox.claim(pool, tmp_path, run["id"], token, run["tree_id"], host="host-b")
    assert await runs.yield_run(pool, run["id"], token) == "runs@host-a"
    row = (await rows(pool, "SELECT status, lease_token, attempt FROM yuxi.runs WHERE id = %s",
                      (run["id"],)))[0]
    assert row == {"status": "ready", "lease_token": None, "attempt": 1}
    assert (await _job_queues(pool, run["id"]))[-1] == "runs@host-a"
    moved = await rows(pool, "SELECT data FROM yuxi.events WHERE run_id = %s AND type = 'run.moved'",
                       (run["id"],))
    assert moved == [{"data": {"from": "host-b", "queue": "runs@host-a"}}]
    # On host-a it claims the same generation.
    token2 = uuid.uuid4()
    again = await runs.start_run(pool, run["id"], token2, 60, host="host-a")
    box = await sandbox.claim(pool, tmp_path, run["id"], token2, again["tree_id"], host="host-a")
    assert box.generation == 1


async def test_without_the_host_check_another_host_would_take_the_sandbox(pool, alice, tmp_path):
    # Negative: the holder check removed from the claim.
    await rewrite_function(pool, "yuxi.claim_sandbox_v1",
                           "IF v_box.host_id IS DISTINCT FROM p_host THEN",
                           "IF false THEN")
    session = await _sandbox_on(pool, alice[1], tmp_path, "host-a")
    _, run, token = await _leased_run(pool, alice[1], "host-b", session)
    box = await sandbox.claim(pool, tmp_path, run["id"], token, run["tree_id"], host="host-b")
    assert box.generation == 1  # host-b would use a sandbox whose files are on host-a


async def test_a_dead_hosts_sandboxes_are_released_and_its_queued_runs_move(pool, alice, tmp_path):
    scope = alice[1]
    await runs.host_heartbeat(pool, "host-a")
    await runs.host_heartbeat(pool, "host-b")
    on_a = await _sandbox_on(pool, scope, tmp_path, "host-a")
    on_b = await _sandbox_on(pool, scope, tmp_path, "host-b")
    await sessions.receive_input(pool, scope, on_a.id, content="queued on a")
    (waiting,) = await runs_with_status(pool, "ready", on_a.tree_id)
    assert await _job_queues(pool, waiting) == ["runs@host-a"]

    # Both alive: nothing happens.
    assert await runs.release_dead_hosts(pool, TIMEOUT) == 0
    # host-a falls silent.
    await scalar(pool, "UPDATE yuxi.hosts SET heartbeat_at = now() - interval '31 seconds' "
                       "WHERE host_id = 'host-a' RETURNING 1")
    assert await runs.release_dead_hosts(pool, TIMEOUT) == 1
    status = {r["tree_id"]: (r["status"], r["host_id"]) for r in await rows(
        pool, "SELECT tree_id, status, host_id FROM yuxi.sandboxes")}
    assert status == {on_a.tree_id: ("released", "host-a"), on_b.tree_id: ("active", "host-b")}
    assert await _job_queues(pool, waiting) == ["runs"]
    # The tree now runs anywhere: host-b provisions a fresh generation.
    token = uuid.uuid4()
    run = await runs.start_run(pool, waiting, token, 60, host="host-b")
    box = await sandbox.claim(pool, tmp_path, waiting, token, run["tree_id"], host="host-b")
    assert box.generation == 2
    assert await scalar(pool, "SELECT host_id FROM yuxi.sandboxes WHERE tree_id = %s",
                        (on_a.tree_id,)) == "host-b"


async def test_without_the_heartbeat_check_a_live_host_would_lose_its_sandboxes(pool, alice,
                                                                               tmp_path):
    # Negative: liveness ignored.
    await rewrite_function(pool, "yuxi.host_alive_v1", "AND heartbeat_at > clock_timestamp() - p_timeout",
                           "AND false")
    await runs.host_heartbeat(pool, "host-a")
    await _sandbox_on(pool, alice[1], tmp_path, "host-a")
    assert await runs.release_dead_hosts(pool, TIMEOUT) == 1


async def test_a_hosts_idle_sweep_releases_only_its_own_sandboxes(pool, alice, tmp_path):
    on_a = await _sandbox_on(pool, alice[1], tmp_path, "host-a")
    later = lambda: dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)  # noqa: E731
    assert await sandbox.release_idle(pool, tmp_path, now=later, host="host-b") == []
    assert await sandbox.release_idle(pool, tmp_path, now=later, host="host-a") == [on_a.tree_id]
