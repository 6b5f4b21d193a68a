"""The cooperation tree with the real executor in-process: child sessions,
the eight tools, durable waits and idempotent effects."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from tests.integration.helpers import drain, new_session, rows, scalar
from yuxi.services import conversation, sessions

CHILD_STEP = {"say": "done {{ input }} at {{ session.path }}"}


def orchestrator(children: int = 6, **extra) -> dict:
    create = [{"tool": "create_session",
               "args": {"name": f"w{i}", "task": f"job {i}", "title": f"worker {i}"}}
              for i in range(children)]
    fetch = [{"tool": "get_result", "args": {"input_id": f"{{{{ results[{i}].input_id }}}}"}}
             for i in range(children)]
    first = children + 1
    return {"model": "replay", "tools": ["cooperation"], **extra, "replay": {
        "rules": [{"match": "^orchestrate", "steps": [
            {"call": create},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
            {"call": fetch},
            {"say": "{{ results[%d:]|map(attribute='output')|map(attribute='text')|join(' | ') }}"
                    % first},
        ]}],
        "default": [CHILD_STEP],
    }}


async def test_fan_out_wait_and_exact_results(pool, checkpoint_pool, alice):
    scope = alice[1]
    root = await new_session(pool, scope, orchestrator())
    receipt = await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    await drain(pool, checkpoint_pool)

    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "completed", result.error
    assert result.output["text"] == " | ".join(f"done job {i} at /root/w{i}" for i in range(6))
    # The parent waited in the same turn: a suspended run, then its resume run.
    parent_runs = await rows(pool, "SELECT status, resume FROM yuxi.runs WHERE turn_id = %s "
                                   "ORDER BY slot_seq", (receipt.turn_id,))
    assert [r["status"] for r in parent_runs] == ["suspended", "completed"]
    assert parent_runs[1]["resume"]["reason"] == "satisfied"
    children = await rows(pool, """SELECT s.name, s.path, s.parent_id, s.title, s.source_run_id
                                   FROM yuxi.sessions s WHERE s.parent_id IS NOT NULL ORDER BY s.path""")
    first_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s AND status = "
                                   "'suspended'", (receipt.turn_id,))
    assert [(c["path"], c["parent_id"], c["source_run_id"]) for c in children] == [
        (f"/root/w{i}", root.id, first_run) for i in range(6)]
    # A child got exactly its task: no parent history.
    history = await conversation.messages(checkpoint_pool, uuid.UUID(
        str(await scalar(pool, "SELECT id FROM yuxi.sessions WHERE path = '/root/w3'"))))
    assert [(m["role"], m["content"]) for m in history] == [
        ("human", "job 3"), ("ai", "done job 3 at /root/w3")]
    # Children stay out of the top-level list.
    listed, _ = await sessions.list_sessions(pool, scope)
    assert [s.id for s in listed] == [root.id]


async def test_children_inherit_the_dispatching_runs_config(pool, checkpoint_pool, alice):
    scope = alice[1]
    config = orchestrator(1, approval_mode="confirm")
    config["replay"]["default"] = [{"say": "{{ model }} {{ approval_mode }}"}]
    root = await new_session(pool, scope, config)
    # A one-off override for this input: the child inherits what the run used.
    await sessions.receive_input(pool, scope, root.id, content="orchestrate",
                                 model="replay/once")
    await drain(pool, checkpoint_pool)
    child_turn = await scalar(pool, "SELECT t.id FROM yuxi.turns t JOIN yuxi.sessions s "
                                    "ON s.id = t.session_id WHERE s.path = '/root/w0'")
    out = await sessions.get_result(pool, scope, child_turn)
    assert out.output["text"] == "replay/once confirm"


@pytest.mark.parametrize("name", ["a/b", "/root/x", ".", "..", "", "x" * 65, "a b", "-x"])
async def test_bad_child_names_are_refused_by_tool_and_service(
        pool, checkpoint_pool, alice, postgresql, name):
    scope = alice[1]
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"default": [
        {"call": [{"tool": "create_session", "args": {"name": name, "task": "t"}}]},
        {"say": "{{ last.error.code }}"}]}}
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="go")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, receipt.turn_id)).output["text"] in (
        "invalid_name", "invalid_arguments")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions") == 1
    # The service refuses it too, whoever calls it.
    with pytest.raises(psycopg.Error) as err:
        postgresql.execute("SELECT yuxi.create_child_session_v1(%s, NULL, %s, NULL, NULL, '{}', 't')",
                           (root.id, name))
    assert err.value.sqlstate == "YX007"


async def test_duplicate_child_name_is_refused(pool, checkpoint_pool, alice):
    scope = alice[1]
    make = {"tool": "create_session", "args": {"name": "same", "task": "t"}}
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
        {"match": "^go", "steps": [{"call": [make]}, {"call": [make]},
                                   {"say": "{{ results[1].error.code }}"}]}],
        "default": [CHILD_STEP]}}
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="go")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, receipt.turn_id)).output["text"] == \
        "invalid_request"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE name = 'same'") == 1
