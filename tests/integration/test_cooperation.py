"""The cooperation tree with the real executor in-process: child sessions,
the eight tools, durable waits and idempotent effects."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from langgraph.types import Interrupt, interrupt

from tests.integration.helpers import (
    drain, events, executor, new_session, rows, runs_with_status, scalar, rewrite_function)
from yuxi.runtime import cooperation
from yuxi.runtime.executor import resumed_waits
from yuxi.runtime.replay import ReplayChatModel
from yuxi.services import conversation, runs, sessions

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
    config = orchestrator(1, system_prompt="be brief")
    config["replay"]["default"] = [{"say": "{{ model }} {{ approval_mode }}"}]
    root = await new_session(pool, scope, config)
    # A one-off override for this input: the child inherits what the run used.
    await sessions.receive_input(pool, scope, root.id, content="orchestrate",
                                 model="replay/once")
    await drain(pool, checkpoint_pool)
    child_turn = await scalar(pool, "SELECT t.id FROM yuxi.turns t JOIN yuxi.sessions s "
                                    "ON s.id = t.session_id WHERE s.path = '/root/w0'")
    out = await sessions.get_result(pool, scope, child_turn)
    assert out.output["text"] == "replay/once auto"
    # The child's frozen config is the dispatching run's actual config.
    child_config = await scalar(pool, "SELECT config FROM yuxi.sessions WHERE name = 'w0'")
    run_config = await scalar(pool, "SELECT config FROM yuxi.runs WHERE session_id = %s "
                                    "ORDER BY slot_seq LIMIT 1", (root.id,))
    assert child_config == run_config and child_config["system_prompt"] == "be brief"


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


async def test_steer_resumes_a_turn_waiting_for_cooperation(pool, checkpoint_pool, alice):
    scope = alice[1]
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
        {"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "slow"}}]},
            {"call": [{"tool": "wait_sessions", "args": {"sessions": ["c"], "timeout_s": 600}}]},
            {"say": "{{ inputs|join('+') }} updates={{ results[1].updates|length }}"}]}],
        "default": [{"say": "child"}]}}
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    from tests.integration.helpers import executor, runs_with_status
    parent_run = (await runs_with_status(pool, "ready"))[0]
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    steer = await sessions.receive_input(pool, scope, root.id, content="hurry")
    assert steer.turn_id == receipt.turn_id
    wait = (await rows(pool, "SELECT status, reason FROM yuxi.waits"))[0]
    assert (wait["status"], wait["reason"]) == ("satisfied", "steer")
    # Run the parent's resume only (the child has not run).
    resume = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s AND status = 'ready'",
                          (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(resume) == "completed"
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "parent+hurry updates=0"


async def test_parent_end_leaves_children_and_notices_wake_no_ended_parent(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
        {"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "work"}}]},
            {"say": "parent finished first"}]}],
        "default": [{"say": "child finished later"}]}}
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    from tests.integration.helpers import executor, runs_with_status
    parent_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "completed"
    child_turn = await scalar(pool, "SELECT t.id FROM yuxi.turns t JOIN yuxi.sessions s "
                                    "ON s.id = t.session_id WHERE s.name = 'c'")
    assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s", (child_turn,)) == "running"
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, child_turn)).output["text"] == "child finished later"
    # The completion is a persisted fact; the ended parent got no new turn or run.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns WHERE session_id = %s", (root.id,)) == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,)) == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE type = 'turn.completed' "
                              "AND turn_id = %s", (child_turn,)) == 1


MEMBER_NOTICES = "SELECT session_id, data FROM yuxi.events WHERE type = 'member.user_input' ORDER BY seq"


async def _user_then_tool_input_on_a_member(pool, checkpoint_pool, scope):
    """A root with one member w0: the user sends w0 an input directly, then
    the root submits one to w0 through its submit_input tool. Returns the
    root, w0, the parent's turn count before, and the notices after each."""
    config = orchestrator(1)
    config["replay"]["rules"].append({"match": "^submit", "steps": [
        {"call": [{"tool": "submit_input", "args": {"session": "w0", "text": "from the parent",
                                                    "mode": "queue"}}]},
        {"say": "submitted"}]})
    root = await new_session(pool, scope, config)
    await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    await drain(pool, checkpoint_pool)
    child = await scalar(pool, "SELECT id FROM yuxi.sessions WHERE parent_id IS NOT NULL")
    parent_turns = await scalar(pool, "SELECT count(*) FROM yuxi.turns WHERE session_id = %s", (root.id,))
    receipt = await sessions.receive_input(pool, scope, child, content="from the user", by_user=True)
    assert receipt.status == "started"  # the same abilities as on a root session
    after_user = await rows(pool, MEMBER_NOTICES)
    turns_after_user = await scalar(pool, "SELECT count(*) FROM yuxi.turns WHERE session_id = %s",
                                    (root.id,))
    assert turns_after_user == parent_turns  # the notice starts no work
    submit = await sessions.receive_input(pool, scope, root.id, content="submit")
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, submit.turn_id)).output["text"] == "submitted"
    # The submission did reach the member.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs WHERE session_id = %s "
                              "AND content = 'from the parent'", (child,)) == 1
    return root, child, after_user, await rows(pool, MEMBER_NOTICES)


async def test_user_input_on_a_member_notifies_its_parent_and_starts_no_work(
        pool, checkpoint_pool, alice):
    # Guard: receive_input_v1 notifies the parent only when p_by_user (the
    # API sets it; the tools never do).
    root, child, after_user, after_tool = await _user_then_tool_input_on_a_member(
        pool, checkpoint_pool, alice[1])
    assert after_user == [{"session_id": root.id, "data": {
        "session_id": str(child), "path": "/root/w0", "mode": "steer"}}]
    # A session submitting to a member through a tool is not a user: no notice.
    assert after_tool == after_user


async def test_without_the_by_user_check_a_tool_submission_notifies_the_parent(
        pool, checkpoint_pool, alice):
    # Negative case: receive_input_v1 without `p_by_user AND` treats every
    # input on a member as the user's: the tool submission notifies too.
    await rewrite_function(pool, "yuxi.receive_input_v1",
                           "IF p_by_user AND v_session.parent_id IS NOT NULL THEN",
                           "IF v_session.parent_id IS NOT NULL THEN")
    root, child, after_user, after_tool = await _user_then_tool_input_on_a_member(
        pool, checkpoint_pool, alice[1])
    assert after_tool[len(after_user):] == [{"session_id": root.id, "data": {
        "session_id": str(child), "path": "/root/w0", "mode": "queue"}}]


async def test_tree_lists_every_member(pool, checkpoint_pool, alice):
    scope = alice[1]
    root = await new_session(pool, scope, orchestrator(2))
    await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    await drain(pool, checkpoint_pool)
    members = await sessions.get_tree(pool, scope, root.id)
    assert [(m["path"], m["status"], m["title"]) for m in members] == [
        ("/root", "idle", None), ("/root/w0", "idle", "worker 0"), ("/root/w1", "idle", "worker 1")]
    child = members[1]["id"]
    assert [m["path"] for m in await sessions.get_tree(pool, scope, child)] == [
        "/root", "/root/w0", "/root/w1"]


async def test_a_waiter_in_another_tree_is_resumed_through_a_job(pool, checkpoint_pool, alice):
    scope = alice[1]
    other = await new_session(pool, scope, {"model": "replay", "replay": {"default": [{"say": "x"}]}})
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"default": [
        {"call": [{"tool": "wait_sessions", "args": {"sessions": [str(other.id)], "timeout_s": 600}}]},
        {"say": "{{ last.updates|map(attribute='type')|join(',') }}"}]}}
    waiter = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, waiter.id, content="wait")
    from tests.integration.helpers import executor, runs_with_status
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "suspended"
    await sessions.receive_input(pool, scope, other.id, content="go")
    await drain(pool, checkpoint_pool)  # the other tree's turn completes
    wait = (await rows(pool, "SELECT id, status, resume_run_id FROM yuxi.waits"))[0]
    assert wait["status"] == "satisfied" and wait["resume_run_id"] is None
    job = await scalar(pool, "SELECT args->>'wait_id' FROM procrastinate.procrastinate_jobs "
                             "WHERE task_name = 'resume_wait'")
    assert job == str(wait["id"])
    from yuxi.services import runs
    await runs.resume_wait(pool, wait["id"])  # what the job does
    await drain(pool, checkpoint_pool)
    assert (await sessions.get_result(pool, scope, receipt.turn_id)).output["text"] == "turn.completed"


async def test_crash_after_the_effect_commit_and_before_the_checkpoint(
        pool, checkpoint_pool, alice):
    """The worker loses its lease right after create_session's effect
    committed and before the step's checkpoint: the next run of the turn
    re-executes the tool, which returns the recorded effect."""
    scope = alice[1]
    # Test-only: recording the effect also ends the lease (the "crash").
    src = await rewrite_function(
        pool, "yuxi.create_session_effects_v1", "        INSERT INTO yuxi.effects",
        "        UPDATE yuxi.runs SET lease_expires_at = now() - interval '1 s' "
        "WHERE id = p_run;\n        INSERT INTO yuxi.effects")
    root = await new_session(pool, scope, orchestrator(1))
    receipt = await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    from tests.integration.helpers import executor
    from yuxi.services import runs
    first = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(first) == "lease_lost"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects") == 1
    # Restore the real function, recover the turn and let it finish.
    async with pool.connection() as conn:
        await conn.execute(src)
    assert await runs.recover_expired(pool, 3) == [first]
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "done job 0 at /root/w0"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id IS NOT NULL") == 1
    effect = (await rows(pool, "SELECT first_run_id FROM yuxi.effects"))[0]
    assert effect["first_run_id"] == first


@pytest.mark.parametrize("guarded", [True, False])
async def test_resume_that_re_executes_sibling_calls_repeats_no_effect(
        pool, checkpoint_pool, alice, guarded):
    scope = alice[1]
    if not guarded:
        # Negative case: without the effect lookup the re-executed sibling
        # sends its message a second time.
        async with pool.connection() as conn:
            await conn.execute("""CREATE OR REPLACE FUNCTION yuxi.find_effect_v1(
                p_turn uuid, p_call_id text, p_tool text, p_fingerprint text) RETURNS jsonb
                LANGUAGE sql AS $$ SELECT NULL::jsonb $$""")
            await conn.execute("ALTER TABLE yuxi.effects DROP CONSTRAINT effects_pkey")
    config = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
        {"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "work"}}]},
            {"call": [{"tool": "send_message", "args": {"session": "c", "text": "ping"}},
                      {"tool": "wait_sessions", "args": {"sessions": ["c"], "timeout_s": 600}}]},
            {"say": "messages={{ results|selectattr('message_id', 'defined')|list|length }}"}]}],
        "default": [{"say": "child"}]}}
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    from tests.integration.helpers import executor, runs_with_status
    parent_run = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,))
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    # Lose the finished sibling's pending write, as if the worker had died
    # before saving it: the resume must re-execute send_message.
    deleted = await scalar(pool, """WITH d AS (DELETE FROM langgraph.checkpoint_writes w
                                     WHERE w.thread_id = %s AND w.task_id IN (
                                         SELECT task_id FROM langgraph.checkpoint_writes
                                          WHERE thread_id = %s AND channel = 'messages')
                                     RETURNING 1)
                                    SELECT count(*) FROM d""", (str(root.id), str(root.id)))
    assert deleted >= 1
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "completed", result.error
    if not guarded:
        assert await scalar(pool, "SELECT count(*) FROM yuxi.messages") == 2
        return
    assert await scalar(pool, "SELECT count(*) FROM yuxi.messages") == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects WHERE tool = 'send_message'") == 1
    history = await conversation.messages(checkpoint_pool, root.id)
    tool_results = [m for m in history if m["role"] == "tool"]
    assert [m["name"] for m in tool_results] == ["create_session", "send_message", "wait_sessions"], history
    assert result.output["text"] == "messages=1"


async def test_a_wait_met_while_it_suspends_goes_on_from_the_wait(
        pool, checkpoint_pool, alice, monkeypatch):
    """The child ends between the wait tool's read and the suspension, which
    then answers 'ready': the run goes on from its wait (the tool answers
    with the child's end), never from the turn's start, which would ask the
    model again for what it already did."""
    scope = alice[1]
    root = await new_session(pool, scope, orchestrator(children=1))
    receipt = await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    (root_run,) = await runs_with_status(pool, "ready")
    steps: list[int] = []
    original_generate = ReplayChatModel._agenerate

    async def counted(self, messages, *args, **kwargs):
        result = await original_generate(self, messages, *args, **kwargs)
        if self.session.get("id") == str(root.id):
            steps.append(result.generations[0].message.response_metadata["replay_step"])
        return result

    monkeypatch.setattr(ReplayChatModel, "_agenerate", counted)
    original_suspend = runs.suspend
    outcomes: list[str] = []

    async def child_ends_first(*args, **kwargs):
        for child_run in await runs_with_status(pool, "ready"):
            assert await executor(pool, checkpoint_pool, continued_runs=0).execute(
                child_run) == "completed"
        outcome, following = await original_suspend(*args, **kwargs)
        outcomes.append(outcome)
        return outcome, following

    monkeypatch.setattr(runs, "suspend", child_ends_first)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(
        root_run) == "completed"
    assert outcomes == ["ready"]
    # Each step of the script once: create, wait, fetch, answer.
    assert steps == [0, 1, 2, 3]
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "done job 0 at /root/w0"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id IS NOT NULL") == 1


@pytest.mark.parametrize("named", [True, False])
async def test_a_resumed_wait_runs_again_without_starting_again(
        pool, checkpoint_pool, alice, monkeypatch, named):
    """The resume re-executes the wait call from its start; its `tool.started`
    committed before it suspended, so the resume run records no start for it
    (no round trip, no tree lock), while the step after it starts its calls
    as ever. An interrupt that does not name its call (one saved before
    interrupts did) is started again, as a new call is."""
    scope = alice[1]
    if not named:
        async def unnamed(ctx, kind, targets, cursor, timeout):
            return interrupt({"kind": kind, "targets": [str(t) for t in targets],
                              "cursor": cursor, "timeout_s": timeout})

        monkeypatch.setattr(cooperation, "_suspend_or_answer", unnamed)
    root = await new_session(pool, scope, orchestrator(children=2))
    receipt = await sessions.receive_input(pool, scope, root.id, content="orchestrate")
    (root_run,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(
        root_run) == "suspended"
    # From here on, every call of start_tool_calls_v1 leaves its tools' names.
    async with pool.connection() as conn:
        await conn.execute("CREATE TABLE public.started_calls (tool text)")
    await rewrite_function(pool, "yuxi.start_tool_calls_v1", "BEGIN\n", """BEGIN
        INSERT INTO public.started_calls
        SELECT e->'data'->>'tool' FROM jsonb_array_elements(p_events) e;
        """)
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.status == "completed", result.error
    assert result.output["text"] == "done job 0 at /root/w0 | done job 1 at /root/w1"
    started = [r["tool"] for r in await rows(pool, "SELECT tool FROM public.started_calls")]
    # The step after the wait (two get_result calls) starts as ever.
    assert started == (["get_result"] * 2 if named else ["wait_inputs"] + ["get_result"] * 2)
    # The wait's start is recorded once either way (its dedupe key).
    assert [e["data"]["tool"] for e in await events(pool, root.tree_id)
            if e["type"] == "tool.started" and e["session_id"] == root.id].count(
        "wait_inputs") == 1


def test_only_wait_interrupts_name_calls_to_resume_without_a_start():
    interrupts = [
        # An approval names its call too, but the call acts once approved:
        # its start keeps the cancel check.
        Interrupt(value={"kind": "approval", "call_id": "act", "tool": "add_note"}, id="1"),
        Interrupt(value={"kind": "questions", "questions": []}, id="2"),
        Interrupt(value={"kind": "inputs", "targets": [], "call_id": "w1"}, id="3"),
        Interrupt(value={"kind": "sessions", "targets": [], "call_id": "w2"}, id="4"),
        # Saved before interrupts named their call: started again, as new.
        Interrupt(value={"kind": "inputs", "targets": []}, id="5"),
    ]
    assert resumed_waits(interrupts) == ["w1", "w2"]
