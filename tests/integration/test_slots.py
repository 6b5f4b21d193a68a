"""Tree slots: at most `slot_capacity` (4) runs of a tree hold a slot at any
instant; released slots go to the oldest pending run, in the same transaction.

Runs are set up directly in SQL (many sessions of one tree, each with one
running turn and a pending run) and then race through `yuxi.claim_slot_v1`.
"""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CAPACITY = 4


def make_tree(conn, members: int) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A root plus `members - 1` children, all in one tree and scope."""
    user = conn.execute("INSERT INTO yuxi.users (name) VALUES (gen_random_uuid()::text) "
                        "RETURNING id").fetchone()[0]
    app = conn.execute("INSERT INTO yuxi.apps (name) VALUES (gen_random_uuid()::text) "
                       "RETURNING id").fetchone()[0]
    root = conn.execute("SELECT id FROM yuxi.create_root_session_v1(%s, %s, NULL, NULL, '{}')",
                        (user, app)).fetchone()[0]
    ids = [root]
    for i in range(members - 1):
        ids.append(conn.execute(
            """INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, name, path, config)
               VALUES (gen_random_uuid(), %s, %s, %s, %s, %s, %s, '{}') RETURNING id""",
            (root, root, user, app, f"m{i}", f"/root/m{i}")).fetchone()[0])
    return root, ids


NEW_PENDING_RUN = """
WITH s AS (SELECT * FROM yuxi.sessions WHERE id = %(session)s),
i AS (INSERT INTO yuxi.inputs (session_id, tree_id, user_id, app_id, content, mode,
                               status, context_snapshot, started_at)
      SELECT id, tree_id, user_id, app_id, 'x', 'queue', 'started', '{}', now() FROM s
      RETURNING *),
t AS (INSERT INTO yuxi.turns (session_id, tree_id, user_id, app_id, input_id, status, started_at)
      SELECT session_id, tree_id, user_id, app_id, id, 'running', now() FROM i RETURNING *)
INSERT INTO yuxi.runs (turn_id, session_id, tree_id, user_id, app_id, config)
SELECT id, session_id, tree_id, user_id, app_id, '{}' FROM t RETURNING id
"""


def holders(conn, tree) -> set[uuid.UUID]:
    return {r[0] for r in conn.execute(
        "SELECT run_id FROM yuxi.slot_claims WHERE tree_id = %s", (tree,))}


async def _race(db_url: str, sessions: list[uuid.UUID], *, hold_until_all_claimed: bool):
    """Each session, on its own connection: create its run, then (all at
    once) claim a slot and commit. Samples committed holders meanwhile."""
    start = asyncio.Barrier(len(sessions))
    claimed = asyncio.Barrier(len(sessions))
    peak = 0
    done = asyncio.Event()

    async def sample(tree):
        nonlocal peak
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            while not done.is_set():
                cur = await conn.execute("SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = %s",
                                         (tree,))
                peak = max(peak, (await cur.fetchone())[0])
                await asyncio.sleep(0.002)

    async def one(session):
        async with await psycopg.AsyncConnection.connect(db_url) as conn:
            run = (await (await conn.execute(NEW_PENDING_RUN, {"session": session})).fetchone())[0]
            await start.wait()
            await conn.execute("SELECT yuxi.claim_slot_v1(%s)", (run,))
            if hold_until_all_claimed:
                await claimed.wait()
            await conn.commit()

    async with await psycopg.AsyncConnection.connect(db_url) as c:
        tree = (await (await c.execute("SELECT tree_id FROM yuxi.sessions WHERE id = %s",
                                       (sessions[0],))).fetchone())[0]
    sampler = asyncio.create_task(sample(tree))
    await asyncio.gather(*(one(s) for s in sessions))
    done.set()
    await sampler
    return tree, peak


async def test_fifty_runs_racing_never_exceed_four_holders(db_url, postgresql):
    _, sessions = make_tree(postgresql, 50)
    postgresql.commit()
    tree, peak = await _race(db_url, sessions, hold_until_all_claimed=False)
    assert peak <= CAPACITY
    assert len(holders(postgresql, tree)) <= CAPACITY
    # Whatever lost the race is pending; filling tops the tree up to capacity.
    postgresql.execute("SELECT yuxi.fill_slots_v1(%s)", (tree,))
    held = holders(postgresql, tree)
    assert len(held) == CAPACITY
    ready = {r[0] for r in postgresql.execute(
        "SELECT id FROM yuxi.runs WHERE tree_id = %s AND status = 'ready'", (tree,))}
    assert ready == held
    # A ready run has its job, deferred in the same transaction.
    jobs = postgresql.execute(
        "SELECT count(*) FROM procrastinate.procrastinate_jobs WHERE args->>'run_id' = ANY(%s)",
        ([str(r) for r in held],)).fetchone()[0]
    assert jobs == CAPACITY


async def test_without_the_tree_lock_the_same_race_overshoots(db_url, postgresql):
    # Negative case: make lock_tree_v1 a plain read and let every racer claim
    # before any commits: the capacity check then counts nothing and all win.
    postgresql.execute("""CREATE OR REPLACE FUNCTION yuxi.lock_tree_v1(p_tree uuid)
                          RETURNS yuxi.trees LANGUAGE sql
                          AS $$ SELECT * FROM yuxi.trees WHERE id = p_tree $$""")
    _, sessions = make_tree(postgresql, 12)
    postgresql.commit()
    tree, peak = await _race(db_url, sessions, hold_until_all_claimed=True)
    assert len(holders(postgresql, tree)) > CAPACITY
    assert peak > CAPACITY


def test_a_claim_waits_for_an_uncommitted_claim_of_the_same_tree(db_url, postgresql):
    # Deterministic two-connection interleaving.
    _, (a, b) = make_tree(postgresql, 2)
    postgresql.commit()
    with psycopg.connect(db_url) as c1, psycopg.connect(db_url) as c2:
        r1 = c1.execute(NEW_PENDING_RUN, {"session": a}).fetchone()[0]
        r2 = c2.execute(NEW_PENDING_RUN, {"session": b}).fetchone()[0]
        c2.commit()
        assert c1.execute("SELECT yuxi.claim_slot_v1(%s)", (r1,)).fetchone()[0] is True
        c2.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            c2.execute("SELECT yuxi.claim_slot_v1(%s)", (r2,))
        c2.rollback()
        c1.commit()
        c2.execute("SET lock_timeout = 0")
        assert c2.execute("SELECT yuxi.claim_slot_v1(%s)", (r2,)).fetchone()[0] is True
        c2.commit()


def test_claiming_twice_is_an_illegal_transition(postgresql):
    _, (a,) = make_tree(postgresql, 1)
    run = postgresql.execute(NEW_PENDING_RUN, {"session": a}).fetchone()[0]
    assert postgresql.execute("SELECT yuxi.claim_slot_v1(%s)", (run,)).fetchone()[0] is True
    with pytest.raises(psycopg.Error) as err:
        postgresql.execute("SELECT yuxi.claim_slot_v1(%s)", (run,))
    assert err.value.sqlstate == "YX001"


def test_a_second_live_run_in_a_session_is_impossible(postgresql):
    _, (a,) = make_tree(postgresql, 1)
    postgresql.execute(NEW_PENDING_RUN, {"session": a})
    with pytest.raises(psycopg.errors.UniqueViolation, match="runs_one_live_per_session|turns_one"):
        postgresql.execute(NEW_PENDING_RUN, {"session": a})


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(1, 4),
       actions=st.lists(st.one_of(st.just(("run", 0)),
                                  st.tuples(st.just("release"), st.integers(0, 7))),
                        min_size=1, max_size=25))
def test_slots_follow_the_fifo_model(postgresql, capacity, actions):
    """Property: after any sequence of new runs and releases, the holders are
    exactly what a FIFO queue with `capacity` servers predicts."""
    tree, sessions = make_tree(postgresql, 26)
    postgresql.execute("UPDATE yuxi.trees SET slot_capacity = %s WHERE id = %s", (capacity, tree))
    model_holders: list[uuid.UUID] = []
    model_queue: list[uuid.UUID] = []
    free_sessions = list(sessions)
    for kind, index in actions:
        if kind == "run":
            run = postgresql.execute(NEW_PENDING_RUN, {"session": free_sessions.pop()}).fetchone()[0]
            got = postgresql.execute("SELECT yuxi.claim_slot_v1(%s)", (run,)).fetchone()[0]
            expect = len(model_holders) < capacity and not model_queue
            assert got is expect
            (model_holders if expect else model_queue).append(run)
        elif model_holders:
            run = model_holders.pop(index % len(model_holders))
            postgresql.execute("UPDATE yuxi.runs SET status = 'completed', finished_at = now() "
                               "WHERE id = %s", (run,))
            postgresql.execute("SELECT yuxi.release_slot_v1(%s)", (run,))
            while model_queue and len(model_holders) < capacity:
                model_holders.append(model_queue.pop(0))
        assert holders(postgresql, tree) == set(model_holders)
        assert len(model_holders) <= capacity
    postgresql.rollback()
