"""Frozen configuration: sessions freeze the agent's config at creation,
inputs freeze the session's config at receipt (plus one-off overrides), and
nothing already accepted changes behind the user's back."""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.integration.helpers import drain, rows, scalar, rewrite_function_sync
from yuxi.errors import InvalidRequest
from yuxi.services import accounts, sessions

SHOW = {"default": [{"say": "{{ input }}: {{ model }} {{ approval_mode }}"}]}


async def _agent(pool, scope, **config):
    return await accounts.create_agent(pool, scope, "a", {"replay": SHOW, **config}, replace=True)


async def _answer(pool, scope, turn_id) -> str:
    return (await sessions.get_result(pool, scope, turn_id)).output["text"]


async def test_model_is_explicit_else_agent_else_default(pool, alice):
    scope = alice[1]
    plain = await _agent(pool, scope)
    s = await sessions.create_session(pool, scope, agent_id=plain.id, default_model="replay/sys")
    assert s.model == "replay/sys" and s.approval_mode == "auto"
    named = await _agent(pool, scope, model="replay/agent", approval_mode="confirm")
    s = await sessions.create_session(pool, scope, agent_id=named.id, default_model="replay/sys")
    assert (s.model, s.approval_mode) == ("replay/agent", "confirm")
    s = await sessions.create_session(pool, scope, agent_id=named.id, default_model="replay/sys",
                                      model="replay/mine", approval_mode="auto")
    assert (s.model, s.approval_mode) == ("replay/mine", "auto")
    # The full context is frozen with the schema defaults.
    config = await scalar(pool, "SELECT config FROM yuxi.sessions WHERE id = %s", (s.id,))
    assert config["replay"] == SHOW and config["max_steps"] == 25 and "system_prompt" in config


async def test_agent_and_default_changes_never_reach_an_existing_session(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    agent = await _agent(pool, scope)
    session = await sessions.create_session(pool, scope, agent_id=agent.id,
                                            default_model="replay/first")
    # Change the agent (model and script) and use another system default.
    await accounts.create_agent(pool, scope, "a", {"model": "replay/changed", "replay": {
        "default": [{"say": "changed"}]}}, replace=True)
    other = await sessions.create_session(pool, scope, agent_id=agent.id,
                                          default_model="replay/second")
    assert other.model == "replay/changed"
    receipt = await sessions.receive_input(pool, scope, session.id, content="x")
    await drain(pool, checkpoint_pool)
    assert await _answer(pool, scope, receipt.turn_id) == "x: replay/first auto"
    run_config = await scalar(pool, "SELECT config FROM yuxi.runs WHERE turn_id = %s",
                              (receipt.turn_id,))
    assert run_config["model"] == "replay/first" and run_config["replay"] == SHOW


async def test_input_overrides_apply_once_and_leave_the_session(pool, checkpoint_pool, alice):
    scope = alice[1]
    agent = await _agent(pool, scope)
    session = await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay")
    one = await sessions.receive_input(pool, scope, session.id, content="one", mode="queue",
                                       model="replay/once", approval_mode="confirm")
    two = await sessions.receive_input(pool, scope, session.id, content="two", mode="queue")
    await drain(pool, checkpoint_pool)
    assert await _answer(pool, scope, one.turn_id) == "one: replay/once confirm"
    assert await _answer(pool, scope, two.turn_id) == "two: replay auto"
    s = await sessions.get_session(pool, scope, session.id)
    assert (s.model, s.approval_mode) == ("replay", "auto")


async def test_queued_input_keeps_its_config_after_an_update(pool, checkpoint_pool, alice):
    scope = alice[1]
    agent = await _agent(pool, scope)
    session = await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay/a")
    first = await sessions.receive_input(pool, scope, session.id, content="1", mode="queue")
    queued = await sessions.receive_input(pool, scope, session.id, content="2", mode="queue")
    await sessions.update_session(pool, scope, session.id,
                                  {"model": "replay/b", "approval_mode": "confirm"})
    after = await sessions.receive_input(pool, scope, session.id, content="3", mode="queue")
    await drain(pool, checkpoint_pool)
    assert [await _answer(pool, scope, r.turn_id) for r in (first, queued, after)] == [
        "1: replay/a auto", "2: replay/a auto", "3: replay/b confirm"]
    snapshots = await rows(pool, "SELECT context_snapshot->>'model' AS m FROM yuxi.inputs ORDER BY seq")
    assert [r["m"] for r in snapshots] == ["replay/a", "replay/a", "replay/b"]


@pytest.mark.parametrize("changes,field", [
    ({"model": ""}, "model"), ({"model": "  "}, "model"), ({"model": None}, "model"),
    ({"approval_mode": None}, "approval_mode"), ({"approval_mode": "sometimes"}, "approval_mode"),
    ({"system_prompt": "x"}, "system_prompt"), ({"title": None}, "title"),
    ({"model": "no-such-model"}, "model"),
])
async def test_bad_updates_are_refused_and_change_nothing(pool, alice, changes, field):
    scope = alice[1]
    agent = await _agent(pool, scope)
    session = await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay")
    before = await scalar(pool, "SELECT config FROM yuxi.sessions WHERE id = %s", (session.id,))
    with pytest.raises(InvalidRequest) as err:
        await sessions.update_session(pool, scope, session.id, changes)
    assert err.value.errors[0]["field"] == field
    assert await scalar(pool, "SELECT config FROM yuxi.sessions WHERE id = %s",
                        (session.id,)) == before


async def test_omitted_fields_are_unchanged(pool, alice):
    scope = alice[1]
    agent = await _agent(pool, scope, approval_mode="confirm")
    session = await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay")
    updated = await sessions.update_session(pool, scope, session.id, {"title": "t"})
    assert (updated.title, updated.model, updated.approval_mode) == ("t", "replay", "confirm")


def wait_until_blocked(observer: psycopg.Connection, pid: int) -> None:
    """Wait until backend `pid` waits for a lock (it is inside the call)."""
    for _ in range(500):
        if observer.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                            (pid,)).fetchone()[0]:
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for a lock")


def _interleave_update_and_receive(db_url, postgresql) -> dict:
    """An update holds the session lock; an input arriving meanwhile waits.
    Returns the config the input was frozen with."""
    user = postgresql.execute("INSERT INTO yuxi.users (name) VALUES ('u') RETURNING id").fetchone()[0]
    app = postgresql.execute("INSERT INTO yuxi.apps (name) VALUES ('a') RETURNING id").fetchone()[0]
    sid = postgresql.execute(
        """SELECT id FROM yuxi.create_root_session_v1(%s, %s, NULL, NULL,
           '{"model": "replay/old", "approval_mode": "auto"}')""", (user, app)).fetchone()[0]
    postgresql.commit()
    receive = "SELECT yuxi.receive_input_v1(%s, %s, %s, 'x', 'queue', '{}', NULL)"
    with psycopg.connect(db_url) as c1, psycopg.connect(db_url) as c2:
        c1.execute("""SELECT yuxi.update_session_v1(%s, %s, %s,
                      '{"model": "replay/new", "approval_mode": "confirm"}')""", (sid, user, app))
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: c2.execute(receive, (sid, user, app)).fetchone()[0])
            wait_until_blocked(postgresql, c2.info.backend_pid)
            c1.commit()
            input_id = pending.result(timeout=10)
        c2.commit()
    return postgresql.execute("SELECT context_snapshot FROM yuxi.inputs WHERE id = %s",
                              (input_id,)).fetchone()[0]


def test_receive_waits_for_an_uncommitted_update_and_sees_it(db_url, postgresql):
    snap = _interleave_update_and_receive(db_url, postgresql)
    assert (snap["model"], snap["approval_mode"]) == ("replay/new", "confirm")


def test_without_the_reread_under_the_lock_the_input_misses_the_update(db_url, postgresql):
    # Negative case: freezing the config read before the lock was taken gives
    # an input received after the update the old settings.
    rewrite_function_sync(postgresql, "yuxi.receive_input_v1",
                          "    SELECT * INTO v_session FROM yuxi.sessions WHERE id = p_session;\n", "")
    postgresql.commit()
    snap = _interleave_update_and_receive(db_url, postgresql)
    assert snap["model"] == "replay/old"


async def test_updates_racing_with_inputs_never_half_apply(pool, alice):
    scope = alice[1]
    agent = await _agent(pool, scope, model="replay/x", approval_mode="auto")
    session = await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay")
    pairs = [{"model": "replay/x", "approval_mode": "auto"},
             {"model": "replay/y", "approval_mode": "confirm"}]

    async def updates():
        for change in itertools.islice(itertools.cycle(pairs), 30):
            await sessions.update_session(pool, scope, session.id, change)

    async def inputs(k):
        for i in range(15):
            await sessions.receive_input(pool, scope, session.id, content=f"{k}-{i}", mode="queue")

    await asyncio.gather(updates(), updates(), inputs(0), inputs(1))
    seen = await rows(pool, """SELECT context_snapshot->>'model' AS model,
                                      context_snapshot->>'approval_mode' AS approval_mode
                               FROM yuxi.inputs""")
    assert len(seen) == 30
    assert all(r in pairs for r in seen), seen
