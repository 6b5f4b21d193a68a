"""Cooperation tools called directly under a real lease: effects, waits,
messages, scope. (test_cooperation.py drives them through the model.)"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid

import pytest

from tests.integration.helpers import (
    drain, new_session, rewrite_function, rows, runs_with_status, scalar, say_agent)
from yuxi.errors import Conflict, InvalidRequest
from yuxi.runtime import cooperation
from yuxi.runtime.tools import ToolContext, ToolError, ToolOutput, call_tool, BUILTIN_TOOLS
from yuxi.services import conversation, runs, sessions


async def running(pool, scope, session_id=None, content="go", config=None):
    """A running run of a new (or given) session and its tool context factory."""
    if session_id is None:
        session_id = (await new_session(pool, scope, config or {
            "model": "replay", "tools": ["cooperation"],
            "replay": {"default": [{"say": "child says {{ input }}"}]}})).id
    await sessions.receive_input(pool, scope, session_id, content=content, mode="queue")
    ready = [r for r in await runs_with_status(pool, "ready")
             if await scalar(pool, "SELECT session_id FROM yuxi.runs WHERE id = %s", (r,)) == session_id]
    token = uuid.uuid4()
    run = await runs.start_run(pool, ready[0], token, 60)

    def ctx(call_id="c1", **kw) -> ToolContext:
        return ToolContext(pool=pool, run_id=run["id"], token=token, call_id=call_id, run=run, **kw)
    return run, token, ctx


async def test_effect_replayed_by_a_later_run_of_the_turn_changes_nothing(pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    args = {"name": "kid", "task": "do it"}
    first = await cooperation.create_session(ctx("call-1"), args)
    assert await cooperation.create_session(ctx("call-1"), args) == first
    # The worker dies; the turn continues in a new run that replays the call.
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = now() - interval '1 s' "
                       "WHERE id = %s RETURNING id", (run["id"],))
    assert await runs.recover_expired(pool, 3) == [run["id"]]
    retry = await scalar(pool, "SELECT id FROM yuxi.runs WHERE turn_id = %s AND status = 'ready'",
                         (run["turn_id"],))
    token2 = uuid.uuid4()
    run2 = await runs.start_run(pool, retry, token2, 60)
    assert run2["turn_id"] == run["turn_id"]
    replay_ctx = ToolContext(pool=pool, run_id=run2["id"], token=token2, call_id="call-1", run=run2)
    assert await cooperation.create_session(replay_ctx, args) == first
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id IS NOT NULL") == 1
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs i JOIN yuxi.sessions s "
                              "ON s.id = i.session_id WHERE s.name = 'kid'") == 1
    # The first source run stays recorded.
    assert await scalar(pool, "SELECT first_run_id FROM yuxi.effects") == run["id"]
    # The same key with another request is refused and writes nothing.
    for changed in ({"name": "other", "task": "do it"}, {"name": "kid", "task": "else"}):
        with pytest.raises(Conflict):
            await cooperation.create_session(replay_ctx, changed)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id IS NOT NULL") == 1


async def test_a_new_turn_may_reuse_a_call_id(pool, checkpoint_pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    await cooperation.create_session(ctx("call-1"), {"name": "a", "task": "t"})
    await runs.complete(pool, run["id"], token, {"text": "x"})
    await drain(pool, checkpoint_pool)  # the child's turn
    _, _, ctx2 = await running(pool, scope, session_id=run["session_id"], content="again")
    second = await cooperation.create_session(ctx2("call-1"), {"name": "b", "task": "t"})
    assert second["path"] == "/root/b"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects") == 2


@pytest.mark.parametrize("tool,args", [
    ("send_message", {"session": "x", "text": "hi"}),
    ("submit_input", {"session": "x", "text": "hi"}),
    ("cancel_turn", {"session": "x", "turn_id": str(uuid.uuid4())}),
])
async def test_effect_tools_are_idempotent_and_conflicts_refused(pool, alice, tool, args):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    child = await cooperation.create_session(ctx("mk"), {"name": "x", "task": "t"})
    if tool == "cancel_turn":
        # A queued turn of the child to cancel.
        receipt = await sessions.receive_input(pool, scope, uuid.UUID(child["session_id"]),
                                               content="later", mode="queue")
        args = {**args, "turn_id": str(receipt.turn_id)}
    fn = getattr(cooperation, tool)
    first = await fn(ctx("e1"), args)
    counts = [await scalar(pool, f"SELECT count(*) FROM yuxi.{t}") for t in ("messages", "inputs", "events")]
    assert await fn(ctx("e1"), args) == first
    assert [await scalar(pool, f"SELECT count(*) FROM yuxi.{t}") for t in ("messages", "inputs", "events")] == counts
    other = {**args, "session": child["session_id"]} if tool != "cancel_turn" else {**args, "turn_id": str(uuid.uuid4())}
    if tool != "cancel_turn":
        other = {**args, "text": "different"}
    with pytest.raises(Conflict):
        await fn(ctx("e1"), other)


async def test_targets_outside_the_scope_are_refused_and_write_nothing(pool, alice, mallory):
    scope = alice[1]
    theirs = await new_session(pool, mallory[1], say_agent())
    run, token, ctx = await running(pool, scope)
    before = await scalar(pool, "SELECT count(*) FROM yuxi.events")
    for tool, args in [
        ("send_message", {"session": str(theirs.id), "text": "hi"}),
        ("submit_input", {"session": str(theirs.id), "text": "hi"}),
        ("wait_sessions", {"sessions": [str(theirs.id)], "timeout_s": 1}),
        ("get_result", {"turn_id": str(uuid.uuid4())}),
    ]:
        out, _ = await call_tool(BUILTIN_TOOLS, ctx(f"x-{tool}"), tool, args)
        assert '"not_found"' in out, (tool, out)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events") == before
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects") == 0


async def test_wait_sessions_refuses_empty_and_self(pool, alice):
    run, token, ctx = await running(pool, alice[1])
    with pytest.raises(ToolError, match="non-empty"):
        await cooperation.wait_sessions(ctx(), {"sessions": []})
    with pytest.raises(ToolError) as err:
        await cooperation.wait_sessions(ctx(), {"sessions": ["/root"]})
    assert err.value.code == "wait_on_self"


async def test_wait_sessions_returns_at_once_after_the_cursor(pool, checkpoint_pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    child = await cooperation.create_session(ctx("mk"), {"name": "c", "task": "t"})
    await drain(pool, checkpoint_pool)  # the child finishes
    out = await cooperation.wait_sessions(ctx(), {"sessions": ["c"]})
    assert isinstance(out, ToolOutput)
    assert [u["type"] for u in out.result["updates"]] == ["turn.completed"]
    assert out.result["timed_out"] is False
    # With the returned cursor nothing new is there: the tool would suspend.
    assert out.cursors == out.result["cursor"]
    again = await rows(pool, "SELECT * FROM yuxi.session_updates_v1(%s, %s, %s)",
                       (run["session_id"], [uuid.UUID(child["session_id"])],
                        __import__("psycopg").types.json.Jsonb(out.cursors)))
    assert again == []


def wait_script(target="c") -> dict:
    return {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
        {"match": "^parent", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "c", "task": "child work"}}]},
            {"call": [{"tool": "wait_sessions", "args": {"sessions": [target], "timeout_s": 30}}]},
            {"say": "{{ last.updates|map(attribute='type')|join(',') }} timed_out={{ last.timed_out }}"},
        ]}],
        "default": [{"say": "child done"}]}}


async def test_wait_timeout_resumes_with_an_explicit_result(pool, checkpoint_pool, alice):
    scope = alice[1]
    config = wait_script()
    config["replay"]["default"] = [{"say": "slow", "delay_ms": 0}]
    root = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    # Run only the parent: it creates the child and suspends on it.
    (parent_run,) = await runs_with_status(pool, "ready")
    from tests.integration.helpers import executor
    assert await executor(pool, checkpoint_pool).execute(parent_run) == "suspended"
    wait = (await rows(pool, "SELECT id, status FROM yuxi.waits"))[0]
    assert wait["status"] == "pending"
    assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s", (receipt.turn_id,)) == "waiting"
    # The parent holds no slot while waiting.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims WHERE run_id = %s", (parent_run,)) == 0
    assert not await runs.expire_wait(pool, wait["id"])  # not due yet
    await scalar(pool, "UPDATE yuxi.waits SET deadline = now() - interval '1 s' RETURNING id")
    # The child's pending run is cancelled out of the way so only the timeout can wake the parent.
    await scalar(pool, "DELETE FROM yuxi.slot_claims WHERE run_id IN (SELECT id FROM yuxi.runs WHERE session_id <> %s) RETURNING run_id", (root.id,))
    await scalar(pool, "UPDATE yuxi.runs SET status = 'failed', error = 'test', finished_at = now() WHERE session_id <> %s AND status IN ('ready','pending') RETURNING id", (root.id,))
    assert await runs.expire_wait(pool, wait["id"])
    assert not await runs.expire_wait(pool, wait["id"])  # at most once
    resumes = await rows(pool, "SELECT id, resume FROM yuxi.runs WHERE turn_id = %s AND resume IS NOT NULL",
                         (receipt.turn_id,))
    assert len(resumes) == 1 and resumes[0]["resume"]["reason"] == "timeout"
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == " timed_out=True"


async def test_child_completion_wakes_the_waiting_parent_once(pool, checkpoint_pool, alice):
    scope = alice[1]
    root = await new_session(pool, scope, wait_script())
    receipt = await sessions.receive_input(pool, scope, root.id, content="parent")
    await drain(pool, checkpoint_pool)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "turn.completed timed_out=False"
    waits = await rows(pool, "SELECT status, reason, resume_run_id FROM yuxi.waits")
    assert len(waits) == 1 and waits[0]["status"] == "satisfied"
    # A duplicated resume creates no extra run.
    wait_id = await scalar(pool, "SELECT id FROM yuxi.waits")
    assert await runs.resume_wait(pool, wait_id) == waits[0]["resume_run_id"]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE turn_id = %s", (receipt.turn_id,)) == 2


async def test_wait_cycle_is_refused_instead_of_hanging(pool, checkpoint_pool, alice):
    scope = alice[1]
    run_a, token_a, ctx_a = await running(pool, scope)
    child = await cooperation.create_session(ctx_a("mk"), {"name": "b", "task": "t"})
    # Make the parent wait on the child (suspended with a pending wait).
    assert await runs.suspend(pool, run_a["id"], token_a, "sessions",
                              [uuid.UUID(child["session_id"])], {}, 60) == ("suspended", None)
    # The child now tries to wait on its parent: that closes a cycle.
    (child_run,) = await runs_with_status(pool, "ready")
    token_b = uuid.uuid4()
    await runs.start_run(pool, child_run, token_b, 60)
    assert await runs.suspend(pool, child_run, token_b, "sessions", [run_a["session_id"]], {},
                              60) == ("cycle", None)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.waits") == 1


async def test_message_to_an_idle_session_waits_for_its_next_execution(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    child = await cooperation.create_session(ctx("mk"), {"name": "c", "task": "first"})
    await drain(pool, checkpoint_pool)  # the child ran and is idle now
    turns_before = await scalar(pool, "SELECT count(*) FROM yuxi.turns")
    await cooperation.send_message(ctx("msg"), {"session": "c", "text": "note this"})
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns") == turns_before  # no turn
    assert await runs_with_status(pool, "ready") == []  # woke nothing
    receipt = await sessions.receive_input(pool, scope, uuid.UUID(child["session_id"]),
                                           content="second")
    await drain(pool, checkpoint_pool)
    history = await conversation.messages(checkpoint_pool, uuid.UUID(child["session_id"]))
    contents = [m["content"] for m in history]
    # Delivered at the child's next model call, after its new input.
    assert contents[2] == "second" and contents[3].endswith("note this")
    assert contents[3].startswith("[cooperation message from /root")
    assert history[4]["role"] == "ai"
    message = (await rows(pool, "SELECT processed_run_id, source_run_id FROM yuxi.messages"))[0]
    assert message["source_run_id"] == run["id"] and message["processed_run_id"] is not None


async def test_list_sessions_pages_the_callers_tree_with_free_slots(pool, checkpoint_pool, alice):
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    for name in ("a", "b", "c"):
        await cooperation.create_session(ctx(f"mk-{name}"), {"name": name, "task": "t"})
    page = await cooperation.list_sessions(ctx(), {"limit": 2})
    assert [s["path"] for s in page["sessions"]] == ["/root", "/root/a"]
    # The caller's run holds one slot and three children hold the others.
    assert page["free_slots"] == 0
    rest = await cooperation.list_sessions(ctx(), {"limit": 2, "cursor": page["next_cursor"]})
    assert [s["path"] for s in rest["sessions"]] == ["/root/b", "/root/c"]
    assert rest["next_cursor"] is None
    kids = await cooperation.list_sessions(ctx(), {"scope": "children"})
    assert [s["path"] for s in kids["sessions"]] == ["/root/a", "/root/b", "/root/c"]
    assert kids["sessions"][0]["queue"] == {"length": 0, "paused": False}
    with pytest.raises(ToolError):
        await cooperation.list_sessions(ctx(), {"scope": "everything"})


async def test_a_step_s_creates_go_in_one_statement_each_with_its_own_outcome(
        pool, alice, monkeypatch):
    # A fan-out's create_session calls are batched (cooperation.create_batch):
    # one statement for the step's calls; a call that fails its batch (a name
    # already taken) gets its error alone, the others their children.
    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    statements: list[int] = []
    original = cooperation.create_sessions

    async def counted(pool_, run_id, token_, config, calls):
        statements.append(len(calls))
        return await original(pool_, run_id, token_, config, calls)

    monkeypatch.setattr(cooperation, "create_sessions", counted)
    creates = cooperation.create_batch(pool, run["id"], token, run["config"])
    names = [f"kid{i}" for i in range(8)]
    outs = await asyncio.gather(*(
        call_tool(BUILTIN_TOOLS, ctx(f"call-{i}", creates=creates), "create_session",
                  {"name": name, "task": "t"}) for i, name in enumerate(names)))
    assert statements == [8]
    assert [json.loads(o)["name"] for o, _ in outs] == names
    statements.clear()
    # kid0 is taken: that call fails, the batch is made again call by call.
    again = ["new1", "kid0", "new2"]
    outs = await asyncio.gather(*(
        call_tool(BUILTIN_TOOLS, ctx(f"again-{i}", creates=creates), "create_session",
                  {"name": name, "task": "t"}) for i, name in enumerate(again)))
    assert statements == [3, 1, 1, 1]
    results = [json.loads(o) for o, _ in outs]
    assert results[0]["name"] == "new1" and results[2]["name"] == "new2"
    assert results[1]["error"]["code"] == "invalid_request", results[1]
    assert sorted(r["name"] for r in await rows(
        pool, "SELECT name FROM yuxi.sessions WHERE parent_id = %s",
        (run["session_id"],))) == sorted([*names, "new1", "new2"])


async def test_a_batch_of_children_takes_the_free_slots_in_order_and_queues_the_rest(
        pool, alice):
    # create_children_v1 writes a batch set-based, as one child after the
    # other would be written: the free slots go to the first children (ready,
    # each with its job), the rest wait in the tree FIFO in the given order,
    # each input is started with its running turn, and the events are the
    # tree's next numbers, per child session.created, input.received,
    # turn.started.
    scope = alice[1]
    run, token, _ctx = await running(pool, scope)
    before = await scalar(pool, "SELECT max(seq) FROM yuxi.events WHERE tree_id = %s",
                          (run["tree_id"],))
    names = [f"k{i}" for i in range(6)]
    results = await cooperation.create_sessions(pool, run["id"], token, run["config"], [
        {"call_id": f"c{i}", "fingerprint": f"f{i}", "name": name, "title": None, "task": f"t{i}"}
        for i, name in enumerate(names)])
    assert [r["name"] for r in results] == names
    kids = await rows(pool, """SELECT s.name, r.status, r.slot_seq, i.status AS input, i.content,
                                      t.status AS turn, i.turn_id = t.id AS same_turn,
                                      EXISTS (SELECT 1 FROM yuxi.slot_claims k
                                               WHERE k.run_id = r.id) AS claimed
                                 FROM yuxi.sessions s JOIN yuxi.runs r ON r.session_id = s.id
                                 JOIN yuxi.turns t ON t.id = r.turn_id
                                 JOIN yuxi.inputs i ON i.id = t.input_id
                                WHERE s.parent_id = %s ORDER BY r.slot_seq""",
                      (run["session_id"],))
    # The root's run holds one of the tree's 4 slots.
    assert [(k["name"], k["status"], k["claimed"]) for k in kids] == [
        (n, "ready" if i < 3 else "pending", i < 3) for i, n in enumerate(names)]
    assert all(k["input"] == "started" and k["turn"] == "running" and k["same_turn"]
               for k in kids)
    assert [k["content"] for k in kids] == [f"t{i}" for i in range(6)]
    jobs = await rows(pool, "SELECT args->>'run_id' AS run FROM procrastinate.procrastinate_jobs "
                            "WHERE task_name = 'execute_run' ORDER BY id")
    ready = await rows(pool, "SELECT id::text FROM yuxi.runs WHERE status = 'ready' "
                             "AND tree_id = %s ORDER BY slot_seq", (run["tree_id"],))
    assert [j["run"] for j in jobs][-3:] == [r["id"] for r in ready]
    events = await rows(pool, """SELECT e.seq, e.type, s.name FROM yuxi.events e
                                  JOIN yuxi.sessions s ON s.id = e.session_id
                                 WHERE e.tree_id = %s AND e.seq > %s ORDER BY e.seq""",
                        (run["tree_id"], before))
    assert [e["seq"] for e in events] == list(range(before + 1, before + 1 + 3 * 6))
    assert [(e["type"], e["name"]) for e in events] == [
        (t, n) for n in names for t in ("session.created", "input.received", "turn.started")]
    # A later batch queues behind the waiting ones, in its own order.
    await cooperation.create_sessions(pool, run["id"], token, run["config"], [
        {"call_id": "c9", "fingerprint": "f9", "name": "late", "title": None, "task": "t"}])
    order = await rows(pool, "SELECT s.name FROM yuxi.runs r JOIN yuxi.sessions s "
                             "ON s.id = r.session_id WHERE r.tree_id = %s AND r.status = 'pending' "
                             "ORDER BY r.slot_seq", (run["tree_id"],))
    assert [o["name"] for o in order] == ["k3", "k4", "k5", "late"]


@pytest.mark.parametrize("guarded", [True, False])
async def test_a_new_child_never_jumps_the_trees_queue(pool, alice, guarded):
    # A slot free while runs wait in the tree's FIFO (here: the tree's
    # capacity raised) belongs to the waiting runs: a new child queues
    # behind them (free_slots_v1). Negative case: without the FIFO check it
    # would start at once.
    if not guarded:
        await rewrite_function(pool, "yuxi.free_slots_v1", "IF EXISTS (SELECT 1 FROM yuxi.runs",
                               "IF false AND EXISTS (SELECT 1 FROM yuxi.runs")
    scope = alice[1]
    run, token, _ctx = await running(pool, scope)

    def calls(*names):
        return [{"call_id": n, "fingerprint": n, "name": n, "title": None, "task": "t"}
                for n in names]
    await cooperation.create_sessions(pool, run["id"], token, run["config"],
                                      calls("a", "b", "c", "d"))
    await scalar(pool, "UPDATE yuxi.trees SET slot_capacity = 8 WHERE id = %s RETURNING id",
                 (run["tree_id"],))
    await cooperation.create_sessions(pool, run["id"], token, run["config"], calls("late"))
    status = await scalar(pool, "SELECT r.status FROM yuxi.runs r JOIN yuxi.sessions s "
                                "ON s.id = r.session_id WHERE s.name = 'late'")
    assert status == ("pending" if guarded else "ready")


async def test_a_batch_repeats_its_recorded_calls_and_makes_only_the_new_ones(pool, alice):
    scope = alice[1]
    run, token, _ctx = await running(pool, scope)

    def call(i, name, fingerprint=None):
        return {"call_id": f"c{i}", "fingerprint": fingerprint or f"f{i}", "name": name,
                "title": None, "task": "t"}
    first = await cooperation.create_sessions(pool, run["id"], token, run["config"],
                                              [call(0, "a")])
    again = await cooperation.create_sessions(pool, run["id"], token, run["config"],
                                              [call(1, "b"), call(0, "a")])
    assert again[1] == first[0] and again[0]["name"] == "b"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id = %s",
                        (run["session_id"],)) == 2
    # The same call id with another request fails the batch: nothing is made.
    with pytest.raises(Conflict):
        await cooperation.create_sessions(pool, run["id"], token, run["config"],
                                          [call(2, "c"), call(0, "a", "changed")])
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id = %s",
                        (run["session_id"],)) == 2
    # A name given twice in one batch is refused like a name already taken.
    with pytest.raises(InvalidRequest):
        await cooperation.create_sessions(pool, run["id"], token, run["config"],
                                          [call(3, "d"), call(4, "d")])


async def test_a_batch_of_creates_is_one_transaction(pool, alice):
    # Why a failed batch is made again call by call: the statement commits
    # all of its calls or none (here none, for the name already taken).
    scope = alice[1]
    run, token, _ctx = await running(pool, scope)
    await cooperation.create_sessions(pool, run["id"], token, run["config"], [
        {"call_id": "c0", "fingerprint": "f0", "name": "kid", "title": None, "task": "t"}])
    with pytest.raises(InvalidRequest):
        await cooperation.create_sessions(pool, run["id"], token, run["config"], [
            {"call_id": f"c{i}", "fingerprint": f"f{i}", "name": name, "title": None,
             "task": "t"} for i, name in ((1, "other"), (2, "kid"))])
    assert await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id = %s",
                        (run["session_id"],)) == 1


async def test_a_recorded_effect_is_made_once(pool, checkpoint_pool, alice):
    # _effect runs the fence, the recorded-result read, the effect and its
    # record in one transaction: a replay, a changed request, a failing
    # effect and a lost lease.
    from yuxi.errors import LeaseLost, NotFound

    scope = alice[1]
    run, token, ctx = await running(pool, scope)
    await cooperation.create_session(ctx("mk"), {"name": "c", "task": "first"})
    sent = await cooperation.send_message(ctx("msg"), {"session": "c", "text": "hi"})
    # A replay of the call returns the recorded result and sends nothing more.
    assert await cooperation.send_message(ctx("msg"), {"session": "c", "text": "hi"}) == sent
    assert await scalar(pool, "SELECT count(*) FROM yuxi.messages") == 1
    # The same call id with another request is refused.
    with pytest.raises(Conflict):
        await cooperation.send_message(ctx("msg"), {"session": "c", "text": "other"})
    # An effect that fails records nothing: the call may be made again.
    with pytest.raises((NotFound, ToolError)):
        await cooperation.send_message(ctx("bad"), {"session": "nobody", "text": "x"})
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects WHERE call_id = 'bad'") == 0
    assert (await cooperation.send_message(ctx("bad"), {"session": "c", "text": "x"})
            )["path"] == "/root/c"
    # A lost lease changes nothing.
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = now() - interval '1 s' "
                       "WHERE id = %s RETURNING id", (run["id"],))
    with pytest.raises(LeaseLost):
        await cooperation.send_message(ctx("late"), {"session": "c", "text": "late"})
    assert await scalar(pool, "SELECT count(*) FROM yuxi.messages") == 2
    assert await scalar(pool, "SELECT count(*) FROM yuxi.effects WHERE call_id = 'late'") == 0
