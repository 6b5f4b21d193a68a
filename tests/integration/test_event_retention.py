"""`yuxi events prune --before T`: old events go; each tree keeps its last
event (numbering continues, never reuses a number), the facts waits consume,
and a live tree keeps its whole log."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

from tests.integration.helpers import (
    drain, events, new_session, rewrite_function, scalar,
)
from yuxi.services import retention, sessions

LATER = lambda: dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)  # noqa: E731
WAIT_FACTS = {"turn.completed", "turn.failed", "turn.cancelled", "turn.waiting",
              "turn.waiting_user", "message.sent"}


async def _idle_tree_with_turns(pool, checkpoint_pool, scope, turns=2):
    session = await new_session(pool, scope)
    for i in range(turns):
        await sessions.receive_input(pool, scope, session.id, content=f"t{i}")
        assert await drain(pool, checkpoint_pool) == ["completed"]
    return session


async def test_prune_keeps_the_last_event_and_what_waits_consume(pool, checkpoint_pool, alice):
    session = await _idle_tree_with_turns(pool, checkpoint_pool, alice[1])
    await sessions.stop_tree(pool, alice[1], session.id)  # the last event is no wait fact
    before = await events(pool, session.tree_id)
    trees, deleted = await retention.prune_events(pool, LATER())
    after = await events(pool, session.tree_id)
    assert trees == 1 and deleted == len(before) - len(after) > 0
    kept = [e for e in before if e["type"] in WAIT_FACTS or e["seq"] == before[-1]["seq"]]
    assert [e["seq"] for e in after] == [e["seq"] for e in kept]
    # Numbering goes on after the last number, never reusing one.
    await sessions.continue_queue(pool, alice[1], session.id)
    await sessions.receive_input(pool, alice[1], session.id, content="again")
    await drain(pool, checkpoint_pool)
    newer = [e["seq"] for e in await events(pool, session.tree_id)][len(after):]
    assert newer == list(range(before[-1]["seq"] + 1, before[-1]["seq"] + 1 + len(newer)))
    # Events created after T stay.
    assert await retention.prune_events(pool, dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)) \
        == (0, 0)


async def test_a_live_tree_keeps_its_whole_log(pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await _idle_tree_with_turns(pool, checkpoint_pool, scope, turns=1)
    await sessions.receive_input(pool, scope, session.id, content="in flight")  # not drained
    before = await events(pool, session.tree_id)
    assert await retention.prune_events(pool, LATER()) == (1, 0)
    assert await events(pool, session.tree_id) == before


async def test_without_keeping_the_last_event_a_number_would_be_reused(
        pool, checkpoint_pool, alice):
    # Negative case: a horizon past the last event deletes it too; the next
    # event of the tree then gets a number a reader has already seen.
    await rewrite_function(pool, "yuxi.prune_tree_events_v1",
                           "least(min(seq) FILTER (WHERE created_at >= p_before), max(seq))",
                           "coalesce(min(seq) FILTER (WHERE created_at >= p_before), max(seq) + 1)")
    session = await _idle_tree_with_turns(pool, checkpoint_pool, alice[1], turns=1)
    await sessions.stop_tree(pool, alice[1], session.id)  # tree.stopped: not a wait fact
    last = (await events(pool, session.tree_id))[-1]
    assert last["type"] == "tree.stopped"
    await retention.prune_events(pool, LATER())
    await sessions.continue_queue(pool, alice[1], session.id)
    await sessions.receive_input(pool, alice[1], session.id, content="again")
    await drain(pool, checkpoint_pool)
    first_new = await scalar(pool, "SELECT min(seq) FROM yuxi.events WHERE tree_id = %s "
                                   "AND type = 'input.received'", (session.tree_id,))
    assert first_new <= last["seq"]


def test_the_cli_prunes_and_refuses_a_bad_time(db_url):
    env = {**os.environ, "YUXI_DATABASE_URL": db_url}
    ok = subprocess.run([sys.executable, "-m", "yuxi.cli", "events", "prune", "--before", "1d"],
                        env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("deleted 0 events created before "), ok
    bad = subprocess.run([sys.executable, "-m", "yuxi.cli", "events", "prune", "--before",
                          "yesterday"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "neither an ISO 8601 time nor an age" in bad.stderr
