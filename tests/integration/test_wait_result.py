"""`?wait` (an input's POST, a turn's result) is woken by its turn's end
(`yuxi_turns`), not by every commit of the turn's tree: it reads the turn
once before waiting and once when woken."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.helpers import executor, new_session, rewrite_function, runs_with_status
from yuxi.api.hub import EventHub
from yuxi.services import sessions


@pytest.fixture
async def hub(db_url, pool):
    hub = EventHub(db_url, pool)
    await hub.start()
    deadline = asyncio.get_running_loop().time() + 10
    while not hub.connected:
        assert asyncio.get_running_loop().time() < deadline, "the hub never listened"
        await asyncio.sleep(0.01)
    yield hub
    await hub.stop()


def _count_reads(monkeypatch) -> list[object]:
    reads: list[object] = []
    original = sessions._result_row

    async def counted(pool, scope, turn_id):
        row = await original(pool, scope, turn_id)
        reads.append(row["status"])
        return row

    monkeypatch.setattr(sessions, "_result_row", counted)
    return reads


async def _wait_while_it_runs(pool, checkpoint_pool, hub, scope, wait: float):
    session = await new_session(pool, scope)
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    waiting = asyncio.create_task(sessions.wait_result(pool, hub, scope, receipt.turn_id, wait))
    await asyncio.sleep(0.2)  # it read the turn and waits
    (run,) = await runs_with_status(pool, "ready")
    # The run's start and its end each commit and notify the tree.
    assert await executor(pool, checkpoint_pool).execute(run) == "completed"
    return await waiting


async def test_a_waiter_reads_its_turn_before_waiting_and_once_it_ended(
        pool, checkpoint_pool, alice, hub, monkeypatch):
    reads = _count_reads(monkeypatch)
    result = await _wait_while_it_runs(pool, checkpoint_pool, hub, alice[1], wait=10)
    assert result.status == "completed" and result.output["text"]
    # Not at the run's start (a commit of its tree), only at the turn's end.
    assert reads == ["running", "completed"]


async def test_without_the_turns_notification_the_waiter_sleeps_to_its_deadline(
        pool, checkpoint_pool, alice, hub, monkeypatch):
    # Negative case: the tree's notifications (the run's start, its end) do
    # not wake a turn's waiter; without `yuxi_turns` it answers at its
    # deadline with the turn as it stands then.
    await rewrite_function(pool, "yuxi.emit_event_v1",
                           "PERFORM pg_notify('yuxi_turns', p_turn::text);", "NULL;")
    reads = _count_reads(monkeypatch)
    began = asyncio.get_running_loop().time()
    result = await _wait_while_it_runs(pool, checkpoint_pool, hub, alice[1], wait=1.5)
    assert asyncio.get_running_loop().time() - began >= 1.4
    assert result.status == "completed"  # read at the deadline
    assert len(reads) == 2


async def test_the_hubs_connection_is_named_for_operators(pool, hub):
    # docs/operator-guide.md counts the API processes listening by this name.
    # (An earlier test's hub, closed, leaves pg_stat_activity a moment after
    # its close returned: the count settles at this hub's one connection.)
    from tests.e2e.helpers import wait_for
    from tests.integration.helpers import scalar

    async def one_named() -> bool:
        return await scalar(pool, "SELECT count(*) FROM pg_stat_activity "
                                  "WHERE application_name = 'yuxi-events' "
                                  "AND datname = current_database()") == 1
    await wait_for(one_named, 5, "one connection named yuxi-events")
