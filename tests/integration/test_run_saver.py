"""The run's checkpointer (yuxi.runtime.saver.RunSaver) holds a turn's input
checkpoint, step 0 and the model node's writes back and writes them with the
next checkpoint in one round trip (issue 15), less what that checkpoint
supersedes (a one-step turn writes one checkpoint); a slow model call gets
the turn's start written meanwhile. A run cut off in between has written
nothing of the turn: the next run starts the turn again, and the
conversation holds its input once; writes of tool calls go out at once."""

from __future__ import annotations

import asyncio

import uuid

import msgspec
import psycopg
import pytest
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from tests.integration import gated
from tests.integration.helpers import (
    checkpoint_reads, drain, executor, new_session, rewrite_function, rows, runs_with_status,
    say_agent, scalar, spy_model_calls)
from yuxi.runtime import saver as saver_module
from yuxi.runtime.saver import RunSaver
from yuxi.services import conversation, runs, sessions


@pytest.fixture
def writes(monkeypatch):
    """The writes (round trips) the run's checkpointer makes: the number of
    statements of each held batch, or the LangGraph method."""
    made: list[int | str] = []
    original = RunSaver._write

    async def counted(self, ops):
        if n := len(self._held) + len(ops):
            made.append(n)
        return await original(self, ops)

    monkeypatch.setattr(RunSaver, "_write", counted)
    original_with = RunSaver.write_with

    async def counted_with(self, query, params):
        what = next(label for key, label in (
            ("start_tool_calls", "tool.started"), ("suspend_run", "suspension"),
            ("suspend_for_user", "user wait"), ("", "completion")) if key in query)
        made.append(f"{len(self._held)} with {what}")
        return await original_with(self, query, params)

    monkeypatch.setattr(RunSaver, "write_with", counted_with)
    original_tasks = RunSaver._flush_task_writes

    async def counted_tasks(self, ops):
        made.append(f"{len(ops)} of tasks")
        return await original_tasks(self, ops)

    monkeypatch.setattr(RunSaver, "_flush_task_writes", counted_tasks)
    for name in ("aput", "aput_writes"):
        def wrap(method, name=name):
            async def langgraphs(self, *args, **kwargs):
                made.append(name)
                return await method(self, *args, **kwargs)
            return langgraphs
        monkeypatch.setattr(AsyncPostgresSaver, name, wrap(getattr(AsyncPostgresSaver, name)))
    return made


INSERTED = """
CREATE TABLE public.inserted (tbl text NOT NULL);
CREATE FUNCTION public.log_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.inserted VALUES (TG_TABLE_NAME);
    RETURN NULL;
END;
$$;
CREATE TRIGGER log_insert AFTER INSERT ON langgraph.checkpoints
    FOR EACH ROW EXECUTE FUNCTION public.log_insert();
CREATE TRIGGER log_insert AFTER INSERT ON langgraph.checkpoint_blobs
    FOR EACH ROW EXECUTE FUNCTION public.log_insert();
CREATE TRIGGER log_insert AFTER INSERT ON langgraph.checkpoint_writes
    FOR EACH ROW EXECUTE FUNCTION public.log_insert();
"""


async def _inserted(pool) -> dict[str, int]:
    return {r["tbl"]: r["n"] for r in await rows(
        pool, "SELECT tbl, count(*) AS n FROM public.inserted GROUP BY tbl")}


async def _one_step_turn(pool, checkpoint_pool, scope):
    async with pool.connection() as conn:
        await conn.execute(INSERTED)
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "completed"
    assert [(m["role"], m["content"]) for m in
            await conversation.messages(checkpoint_pool, session.id)] == [
        ("human", "q"), ("ai", "answer to q")]
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert result.output["text"] == "answer to q"
    return session


async def test_a_one_step_turn_writes_its_last_checkpoint_once_with_its_completion(
        pool, checkpoint_pool, alice, writes):
    # The input checkpoint, its writes, step 0, the model's writes and step 1
    # (the last: no tool call) go out in one round trip with the completion
    # (LangGraph's saver alone makes five writes, the completion a sixth),
    # and of those rows only step 1 and the blobs it references: the
    # completion would prune the others at once.
    session = await _one_step_turn(pool, checkpoint_pool, alice[1])
    assert len(writes) == 1 and writes[0].endswith(" with completion"), writes
    inserted = await _inserted(pool)
    assert inserted.get("checkpoints") == 1 and "checkpoint_writes" not in inserted, inserted
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints "
                              "WHERE thread_id = %s", (str(session.id),)) == 1


async def test_without_latest_only_every_step_is_written_and_pruned(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: the held rows all written, as LangGraph's saver would,
    # only for the completion to delete them again.
    monkeypatch.setattr(saver_module, "latest_only", lambda ops: ops)
    session = await _one_step_turn(pool, checkpoint_pool, alice[1])
    inserted = await _inserted(pool)
    assert inserted["checkpoints"] == 3 and inserted["checkpoint_writes"] >= 2, inserted
    assert await scalar(pool, "SELECT count(*) FROM langgraph.checkpoints "
                              "WHERE thread_id = %s", (str(session.id),)) == 1


async def _flushes(monkeypatch) -> asyncio.Queue:
    """Each write of what was held (during a model call: the turn's start)."""
    done: asyncio.Queue = asyncio.Queue()
    original = RunSaver._write

    async def signalled(self, ops):
        held = len(self._held)
        await original(self, ops)
        if held:
            done.put_nowait(held)

    monkeypatch.setattr(RunSaver, "_write", signalled)
    return done


@pytest.mark.parametrize("slow", [True, False])
async def test_a_slow_model_call_shows_the_turns_input_meanwhile(
        pool, checkpoint_pool, alice, monkeypatch, slow):
    # While the model thinks, the turn in flight shows its input in the
    # conversation (GET .../messages reads the latest checkpoint). Negative
    # case (slow=False): within HOLD_SECONDS nothing is written, so during
    # the call the conversation does not show the input yet.
    monkeypatch.setattr(saver_module, "HOLD_SECONDS", 0 if slow else 3600)
    flushed = await _flushes(monkeypatch)
    with gated.gated_model() as gate:
        session, _receipt, task = await gated.start_run(
            pool, checkpoint_pool, alice[1], {"model": "gated", "replay": {
                "default": [{"say": "answer to {{ input }}"}]}}, content="q")
        await gate.calls.get()  # the model call waits at the gate
        if slow:
            await flushed.get()
        assert [(m["role"], m["content"]) for m in
                await conversation.messages(checkpoint_pool, session.id)] == (
            [("human", "q")] if slow else [])
        assert not task.done()
        gate.pass_waiting()
        assert await task == "completed"
    assert flushed.empty()
    assert [m["role"] for m in await conversation.messages(checkpoint_pool, session.id)] == [
        "human", "ai"]


async def _recover_and_finish(pool, checkpoint_pool, scope, session, receipt, run_id):
    """The cut-off run recovered (its lease expired by the fault report) and
    its turn finished by the new run: "q" answered once."""
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    assert retry == run_id
    (ready,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(ready) == "completed"
    assert [(m["role"], m["content"]) for m in
            await conversation.messages(checkpoint_pool, session.id)] == [
        ("human", "q"), ("ai", "answer to q")]
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "answer to q")


async def test_a_run_cut_off_before_its_held_input_is_written_starts_the_turn_again(
        pool, checkpoint_pool, alice, monkeypatch):
    # A slow model call: the turn's start goes out during it (and is cut off).
    scope = alice[1]
    monkeypatch.setattr(saver_module, "HOLD_SECONDS", 0)
    session = await new_session(pool, scope, say_agent("answer to {{ input }}", delay_ms=50))
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    # The connection dies as the held input would go out.
    original, _ = _cut_off_held_write(monkeypatch)
    assert await executor(pool, checkpoint_pool).execute(run_id) == "infra_fault"
    assert await conversation.messages(checkpoint_pool, session.id) == []
    monkeypatch.setattr(RunSaver, "_write", original)
    # Recovery continues the turn in a new run (its lease was expired by the
    # fault report), which finds no input in the conversation.
    await _recover_and_finish(pool, checkpoint_pool, scope, session, receipt, run_id)
    assert [r["attempt"] for r in await rows(
        pool, "SELECT attempt FROM yuxi.runs WHERE turn_id = %s ORDER BY attempt",
        (receipt.turn_id,))] == [1, 2]


async def test_calls_that_end_together_go_with_their_steps_checkpoint(
        pool, checkpoint_pool, alice, writes):
    # No call of the step runs once both echoes ended: their writes wait for
    # the step's checkpoint, which LangGraph writes next, and go with it.
    scope = alice[1]
    session = await new_session(pool, scope, TWO_ECHOES)
    await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "completed"
    # input + step 0 + model writes + step 1 (8 statements) with the calls'
    # tool.started, before either runs | the writes of echo a and echo b
    # with step 2 (its blobs and checkpoint): one round trip for the tool
    # step | model writes + step 3 with the completion.
    assert writes == ["8 with tool.started", 4, "3 with completion"], writes
    assert [(m["role"], m["content"]) for m in
            await conversation.messages(checkpoint_pool, session.id)] == [
        ("human", "q"), ("ai", ""), ("tool", '{"text":"a"}'), ("tool", '{"text":"b"}'),
        ("ai", "done")]


# A step whose echo ends while its wait still runs (the wait reads the
# database before it interrupts; echo does not).
ECHO_WHILE_WAITING = {"model": "replay", "tools": ["cooperation", "echo"], "replay": {
    "rules": [{"match": "^wake", "steps": [
        {"call": [{"tool": "create_session", "args": {"name": "w", "task": "child"}}]},
        {"call": [{"tool": "echo", "args": {"text": "meanwhile"}},
                  {"tool": "wait_inputs", "args": {
                      "input_ids": "{{ results|map(attribute='input_id')|list }}",
                      "timeout_s": 60}}]},
        {"say": "woke"}]}],
    "default": [{"say": "child done"}]}}


async def test_a_call_ending_while_another_runs_is_written_at_once(
        pool, checkpoint_pool, alice, writes):
    # Tool calls may have effects and a later one may take long: the writes
    # of one that ends while another of its step still runs are durable at
    # once, never held for the step's checkpoint.
    scope = alice[1]
    session, receipt = await _waiting_parent(pool, checkpoint_pool, scope, ECHO_WHILE_WAITING)
    # The create's step with its tool.started | its result with the step
    # that applied it | the model's writes and step with the two calls'
    # tool.started | echo's result, alone, while the wait runs | the wait's
    # interrupt with the suspension.
    assert writes == ["8 with tool.started", 3, "3 with tool.started", "1 of tasks", 1,
                      "1 with suspension"], writes
    await drain(pool, checkpoint_pool, continued_runs=0)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke")
    assert await _tools_finished(pool, session) == 3


async def test_the_last_checkpoint_commits_with_the_completion_or_not_at_all(
        pool, checkpoint_pool, alice, monkeypatch):
    # The connection dies as the turn's steps and the completion go out
    # together: none is there; the next run starts the turn again.
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    original = RunSaver.write_with

    async def cut_off(self, query, params):
        assert self._held  # the model's writes and its step's checkpoint
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(RunSaver, "write_with", cut_off)
    assert await executor(pool, checkpoint_pool).execute(run_id) == "infra_fault"
    # Nothing of the turn is there; the turn runs on.
    assert await conversation.messages(checkpoint_pool, session.id) == []
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "running"
    monkeypatch.setattr(RunSaver, "write_with", original)
    await _recover_and_finish(pool, checkpoint_pool, scope, session, receipt, run_id)


TWO_ECHOES = {"model": "replay", "tools": ["echo"], "replay": {"default": [
    {"call": [{"tool": "echo", "args": {"text": "a"}}, {"tool": "echo", "args": {"text": "b"}}]},
    {"say": "done"}]}}


def _count_echoes(monkeypatch) -> list[str]:
    from yuxi.runtime import tools as tools_module
    echoed: list[str] = []
    echo = tools_module.BUILTIN_TOOLS["echo"]

    async def counted(ctx, args):
        echoed.append(args["text"])
        return await echo.fn(ctx, args)

    monkeypatch.setitem(tools_module.BUILTIN_TOOLS, "echo",
                        msgspec.structs.replace(echo, fn=counted))
    return echoed


async def test_an_answer_with_tool_calls_is_saved_with_the_calls_start(
        pool, checkpoint_pool, alice):
    # The answer's `message` event, its step's checkpoint and the calls'
    # `tool.started` commit in one transaction, before any tool runs.
    scope = alice[1]
    session = await new_session(pool, scope, TWO_ECHOES)
    await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "completed"
    found = await rows(pool, "SELECT type, seq, xmin::text AS tx FROM yuxi.events "
                             "WHERE session_id = %s AND (type = 'tool.started' OR type = "
                             "'message' AND data->'tool_calls' <> '[]') ORDER BY seq",
                       (session.id,))
    assert [r["type"] for r in found] == ["message", "tool.started", "tool.started"]
    assert len({r["tx"] for r in found}) == 1
    assert [r["seq"] for r in found] == list(range(found[0]["seq"], found[0]["seq"] + 3))
    # (That the answer's step commits with them: the cut-off test below.)


def _cut_off_held_write(monkeypatch, close: bool = False):
    """The connection dies as the saver's held writes would go out (closed,
    when `close`). Returns the original `_write`, to put back, and the
    number of statements of each write cut off (held and new)."""
    original = RunSaver._write
    cut: list[int] = []

    async def cut_off(self, ops):
        if self._held:
            cut.append(len(self._held) + len(ops))
            if close:
                await self.conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await original(self, ops)

    monkeypatch.setattr(RunSaver, "_write", cut_off)
    return original, cut


def _cut_off_at(monkeypatch, fragment: str, held: bool = False, close: bool = False):
    """The connection dies as the saver's write_with of a query containing
    `fragment` goes out (with what it holds, when `held`; closed, when
    `close`, so that no later write of the run gets through either).
    Returns the original method, to put back."""
    original = RunSaver.write_with

    async def cut_off(self, query, params):
        if fragment in query:
            assert self._held or not held
            if close:
                await self.conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await original(self, query, params)

    monkeypatch.setattr(RunSaver, "write_with", cut_off)
    return original


async def test_a_run_cut_off_as_its_calls_start_runs_no_tool(
        pool, checkpoint_pool, alice, monkeypatch):
    # The connection dies as the answer's step and the calls' start go out:
    # nothing of the step is saved and no tool ran; the next run asks the
    # model again and runs each tool once.
    scope = alice[1]
    echoed = _count_echoes(monkeypatch)
    session = await new_session(pool, scope, TWO_ECHOES)
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    original = _cut_off_at(monkeypatch, "start_tool_calls")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "infra_fault"
    assert echoed == []
    assert await conversation.messages(checkpoint_pool, session.id) == []
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE session_id = %s "
                              "AND type IN ('message', 'tool.started')", (session.id,)) == 0
    monkeypatch.setattr(RunSaver, "write_with", original)
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    (ready,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(ready) == "completed"
    assert sorted(echoed) == ["a", "b"]
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "done")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE session_id = %s "
                              "AND type = 'message' AND data->'tool_calls' <> '[]'",
                        (session.id,)) == 1


async def test_a_tools_finish_goes_with_its_result(pool, checkpoint_pool, alice,
                                                  monkeypatch, writes):
    # The calls' tool.finished events take no round trip of their own: they
    # go with the tools' results (the saver's next write, here with the
    # step's checkpoint).
    from yuxi.runtime.executor import EventReporter
    own: list[int] = []
    original = EventReporter._finish_calls

    async def counted(self, finished):
        own.append(len(finished))
        return await original(self, finished)

    monkeypatch.setattr(EventReporter, "_finish_calls", counted)
    scope = alice[1]
    session = await new_session(pool, scope, TWO_ECHOES)
    await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "completed"
    assert own == []
    assert writes == ["8 with tool.started", 4, "3 with completion"]
    found = await rows(pool, "SELECT data->>'call_id' AS call, xmin::text AS tx "
                             "FROM yuxi.events WHERE session_id = %s AND type = 'tool.finished'",
                       (session.id,))
    assert len(found) == 2 and len({r["tx"] for r in found}) == 1


# A parent that waits for a child, then loops on echo calls: its resumed run
# starts with the wait's tool step, so the step limit (an even number of
# steps) ends it right after an answer that asks for a call.
LOOPS_AFTER_A_WAIT = {"model": "replay", "tools": ["cooperation", "echo"], "max_steps": 2,
                      "replay": {"rules": [{"match": "^wake", "steps": [
                          {"call": [{"tool": "create_session",
                                     "args": {"name": "w", "task": "child"}}]},
                          {"call": [{"tool": "wait_inputs", "args": {
                              "input_ids": "{{ results|map(attribute='input_id')|list }}",
                              "timeout_s": 60}}]},
                          *[{"call": [{"tool": "echo", "args": {"text": "x"}}]}] * 9]}],
                                 "default": [{"say": "child done"}]}}


async def _last_answer_kept(pool, checkpoint_pool, scope) -> tuple[list[str], int]:
    session = await new_session(pool, scope, LOOPS_AFTER_A_WAIT)
    receipt = await sessions.receive_input(pool, scope, session.id, content="wake")
    (first,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(first) \
        == "suspended"
    (child,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(child) \
        == "completed"
    (resumed,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(resumed) \
        == "failed"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "failed"
    roles = [m["role"] for m in await conversation.messages(checkpoint_pool, session.id)]
    answers = await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE session_id = %s "
                                 "AND type = 'message'", (session.id,))
    return roles, answers


async def test_a_turn_failing_at_its_step_limit_keeps_its_last_answer(
        pool, checkpoint_pool, alice):
    # The step limit ends the turn right after an answer that asks for a
    # tool call: the answer (its event and its step) is saved all the same.
    roles, answers = await _last_answer_kept(pool, checkpoint_pool, alice[1])
    assert roles[-2:] == ["tool", "ai"], roles
    assert answers == roles.count("ai")


async def test_without_the_flush_the_failed_turns_last_answer_is_lost(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative: without saving what waited for the calls' start (the step
    # and the answer's event, which goes along), the last answer is neither
    # in the conversation nor among the events.
    async def nothing(self) -> None:
        return None

    monkeypatch.setattr(RunSaver, "write_held", nothing)
    roles, answers = await _last_answer_kept(pool, checkpoint_pool, alice[1])
    assert roles[-2:] == ["ai", "tool"], roles
    assert answers == roles.count("ai")


async def test_a_completion_refused_by_the_fence_writes_no_checkpoint(
        pool, checkpoint_pool, alice, monkeypatch):
    # The lease is lost just before the completion (another run took the
    # turn over): complete_run_v1 raises YX003 and the held checkpoint of
    # the final step, in the same transaction, is not written either.
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    original = RunSaver.write_with

    async def expire_first(self, query, params):
        async with pool.connection() as conn:
            await conn.execute("UPDATE yuxi.runs SET lease_token = gen_random_uuid() "
                               "WHERE id = %s", (run_id,))
        return await original(self, query, params)

    monkeypatch.setattr(RunSaver, "write_with", expire_first)
    assert await executor(pool, checkpoint_pool).execute(run_id) == "lease_lost"
    assert await conversation.messages(checkpoint_pool, session.id) == []


async def _two_turns(pool, checkpoint_pool, scope):
    session = await new_session(pool, scope, say_agent("answer to {{ input }}"))
    for text in ("one", "two"):
        await sessions.receive_input(pool, scope, session.id, content=text)
        (run_id,) = await runs_with_status(pool, "ready")
        assert await executor(pool, checkpoint_pool).execute(run_id) == "completed"
    return session


async def test_a_runs_first_read_comes_with_its_lease(
        pool, checkpoint_pool, alice, monkeypatch):
    reads = checkpoint_reads(monkeypatch)
    seen = spy_model_calls(monkeypatch)
    session = await _two_turns(pool, checkpoint_pool, alice[1])
    # No run read the checkpoint in a round trip of its own: the first
    # turn's thread had none; the second turn's run read it (what the earlier
    # turn left there, and LangGraph's start) and the archive in its lease's
    # round trip (runs.start_run_reading).
    assert reads == []
    assert seen == [["one"], ["one", "answer to one", "two"]]
    assert [(m["role"], m["content"]) for m in
            await conversation.messages(checkpoint_pool, session.id)] == [
        ("human", "one"), ("ai", "answer to one"), ("human", "two"), ("ai", "answer to two")]


async def test_without_the_leases_read_a_later_turn_reads_its_checkpoint(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: what the lease read is not used; the second turn's run
    # reads the checkpoint with the archive (one round trip of its own) and
    # sees the same conversation.
    async def unknown(self, thread_id, row):
        return False

    monkeypatch.setattr(RunSaver, "know_latest", unknown)
    reads = checkpoint_reads(monkeypatch)
    seen = spy_model_calls(monkeypatch)
    session = await _two_turns(pool, checkpoint_pool, alice[1])
    assert reads == [str(session.id)]
    assert seen == [["one"], ["one", "answer to one", "two"]]


async def test_only_the_first_run_of_the_first_turn_is_first(pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope, say_agent())
    await sessions.receive_input(pool, scope, session.id, content="one")
    await sessions.receive_input(pool, scope, session.id, content="two", mode="queue")
    (first,) = await runs_with_status(pool, "ready")
    flag = "SELECT (yuxi.leased_run_v1(%s)).first_run AS first"
    assert (await rows(pool, flag, (first,)))[0]["first"] is True
    # Its retry after a lost lease is not (its predecessor may have written).
    token = uuid.uuid4()
    await runs.start_run(pool, first, token, 30)
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() - "
                       "interval '1 s' WHERE id = %s RETURNING id", (first,))
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    (ready,) = await runs_with_status(pool, "ready")
    assert (await rows(pool, flag, (ready,)))[0]["first"] is False
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(ready) == "completed"
    (second,) = await runs_with_status(pool, "ready")
    assert (await rows(pool, flag, (second,)))[0]["first"] is False


async def test_without_the_first_turn_check_a_later_turn_would_lose_its_history(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative: every attempt-1 run taken for the session's first: the second
    # turn's model would not see the first turn. (Where the lease read the
    # checkpoint, that read knows better; the flag is what a run handed over
    # from another session's completion goes by: no read with the lease.)
    await rewrite_function(pool, "yuxi.leased_run_v1", "p.seq < t.seq", "false")

    async def unknown(self, thread_id, row):
        return False

    monkeypatch.setattr(RunSaver, "know_latest", unknown)
    seen = spy_model_calls(monkeypatch)
    await _two_turns(pool, checkpoint_pool, alice[1])
    assert seen == [["one"], ["two"]]


@pytest.mark.parametrize("first", ["completed", "failed"])
async def test_a_turns_first_run_reads_the_archive_with_the_checkpoint(
        pool, checkpoint_pool, alice, monkeypatch, first):
    # A completed turn was archived by its completion: the next turn's first
    # run reads it with the checkpoint (one round trip) and writes nothing.
    # A failed one was not: that run archives it first (archive_and_load).
    from tests.integration.test_conversation_archive import FAILS_ON_LOOP

    archived: list[int] = []
    original = conversation.archive_and_load

    async def spied(conn, run_id, token, earlier=(), cache=None):
        archived.append(len(earlier))
        return await original(conn, run_id, token, earlier, cache)

    monkeypatch.setattr(conversation, "archive_and_load", spied)
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    session = await new_session(pool, scope, FAILS_ON_LOOP)
    for text, outcome in (("one" if first == "completed" else "loop", first), ("two", "")):
        await sessions.receive_input(pool, scope, session.id, content=text)
        (run_id,) = await runs_with_status(pool, "ready")
        assert await executor(pool, checkpoint_pool).execute(run_id) == (outcome or "completed")
    if first == "completed":
        assert archived == [] and seen[-1] == ["one", "echo: one", "two"]
    else:
        assert len(archived) == 1 and archived[0] >= 2 and seen[-1][0] == "loop"
    assert [m["content"] for m in await conversation.messages(checkpoint_pool, session.id)
            if m["role"] == "human"] == ["one" if first == "completed" else "loop", "two"]


@pytest.mark.parametrize("pending", [False, True], ids=["no pending writes", "pending writes"])
async def test_a_read_checkpoint_is_langgraphs_tuple(checkpoint_pool, pending, monkeypatch):
    # RunSaver builds a checkpoint without pending writes itself (LangGraph
    # loads the writes in a thread); what it returns must not differ. With
    # pending writes it is LangGraph's own path: each case is the other's
    # reference.
    from langgraph.checkpoint.base import empty_checkpoint
    from langchain_core.messages import HumanMessage

    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    async with checkpoint_pool.connection() as conn:
        plain = AsyncPostgresSaver(conn)
        first = empty_checkpoint()
        first["channel_values"] = {"messages": [HumanMessage("hi", id="h")], "count": 3}
        first["channel_versions"] = {"messages": "1", "count": "1"}
        stored = await plain.aput(config, first, {"source": "input", "step": -1},
                                  {"messages": "1", "count": "1"})
        if pending:
            await plain.aput_writes(stored, [("messages", [HumanMessage("later", id="l")])],
                                    "task-1")
        threaded = []
        original = saver_module.AsyncPostgresSaver._load_checkpoint_tuple

        async def spied(self, value):
            threaded.append(bool(value["pending_writes"]))
            return await original(self, value)

        monkeypatch.setattr(saver_module.AsyncPostgresSaver, "_load_checkpoint_tuple", spied)
        ours = await RunSaver(conn).aget_tuple(config)
        monkeypatch.setattr(saver_module.AsyncPostgresSaver, "_load_checkpoint_tuple", original)
        theirs = await plain.aget_tuple(config)
    assert ours == theirs
    assert bool(ours.pending_writes) is pending
    assert threaded == ([True] if pending else [])


async def test_later_reads_are_answered_from_the_first_each_with_its_own_copy(
        checkpoint_pool, monkeypatch):
    # A resumed run reads its state (aget_state), then LangGraph reads the
    # checkpoint again to go on: one round trip for both. aget_state applies
    # the pending writes to the checkpoint it got (versions, in place); the
    # loop's read must not start from that.
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.base import empty_checkpoint

    thread = str(uuid.uuid4())
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    async with checkpoint_pool.connection() as conn:
        first = empty_checkpoint()
        first["channel_values"] = {"messages": [HumanMessage("hi", id="h")]}
        first["channel_versions"] = {"messages": "1"}
        first["versions_seen"] = {"model": {"messages": "1"}}
        await AsyncPostgresSaver(conn).aput(config, first, {"source": "input", "step": -1},
                                            {"messages": "1"})
        saver = RunSaver(conn)
        reads = []
        original = AsyncPostgresSaver.aget_tuple

        async def counted(self, cfg):
            reads.append(cfg)
            return await original(self, cfg)

        monkeypatch.setattr(AsyncPostgresSaver, "aget_tuple", counted)
        looked = await saver.aget_tuple(config)
        looked.checkpoint["channel_versions"]["messages"] = "2"
        looked.checkpoint["versions_seen"]["model"]["messages"] = "2"
        again = await saver.aget_tuple(config)
        # Known without a read (carried from the previous run, or read with
        # the lease): both reads are answered from it.
        carried = RunSaver(conn, latest=looked)
        await carried.aget_tuple(config)
        await carried.aget_tuple(config)
    assert len(reads) == 1
    assert again.checkpoint["channel_versions"] == {"messages": "1"}
    assert again.checkpoint["versions_seen"] == {"model": {"messages": "1"}}
    assert again.checkpoint["channel_values"]["messages"][0].content == "hi"


FAILS_AT_ONCE = {"model": "replay", "replay": {"default": [{"say": "{{ no_such_thing() }}"}]}}


async def _failed_at_once(pool, checkpoint_pool, scope) -> list[str]:
    session = await new_session(pool, scope, FAILS_AT_ONCE)
    receipt = await sessions.receive_input(pool, scope, session.id, content="q")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id) == "failed"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "failed"
    return [(m["role"], m["content"]) for m in
            await conversation.messages(checkpoint_pool, session.id)]


async def test_a_turn_whose_model_fails_at_once_keeps_its_input(pool, checkpoint_pool, alice):
    # The model fails within HOLD_SECONDS, while the turn's start is held:
    # it is written before the turn fails, as it is when the model fails
    # later, so the conversation holds the failed turn's input.
    assert await _failed_at_once(pool, checkpoint_pool, alice[1]) == [("human", "q")]


async def test_without_the_flush_a_turn_failing_at_once_leaves_no_input(
        pool, checkpoint_pool, alice, monkeypatch):
    async def nothing(self) -> None:
        return None

    monkeypatch.setattr(RunSaver, "write_held", nothing)
    assert await _failed_at_once(pool, checkpoint_pool, alice[1]) == []


WAITS_FOR_A_CHILD = {"model": "replay", "tools": ["cooperation"], "replay": {
    "rules": [{"match": "^wake", "steps": [
        {"call": [{"tool": "create_session", "args": {"name": "w", "task": "child"}}]},
        {"call": [{"tool": "wait_inputs", "args": {
            "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
        {"say": "woke: {{ results[-1].inputs[0].status }}"}]}],
    "default": [{"say": "child done"}]}}


async def _waiting_parent(pool, checkpoint_pool, scope, config=WAITS_FOR_A_CHILD):
    """A parent's turn (`config`'s "wake" rule) suspended on its child's
    input; the child's run is ready."""
    session = await new_session(pool, scope, config)
    receipt = await sessions.receive_input(pool, scope, session.id, content="wake")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(run_id) \
        == "suspended"
    return session, receipt


async def _resumed_parent(pool, checkpoint_pool, scope):
    """A waiting parent (`_waiting_parent`) whose child's turn completed:
    the parent's resumed run is ready (returned third)."""
    session, receipt = await _waiting_parent(pool, checkpoint_pool, scope)
    (child_run,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(child_run) \
        == "completed"
    (resumed,) = await runs_with_status(pool, "ready")
    return session, receipt, resumed


async def _woken_after_recovery(pool, checkpoint_pool, scope, receipt, run_id):
    """The cut-off run `run_id` recovered (the fault report expired its
    lease), and the turn ends as it would have without the cut."""
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    assert retry == run_id
    await drain(pool, checkpoint_pool, continued_runs=0)
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke: completed")


async def _children(pool) -> int:
    return await scalar(pool, "SELECT count(*) FROM yuxi.sessions WHERE parent_id IS NOT NULL")


async def _tools_finished(pool, session) -> int:
    return await scalar(pool, "SELECT count(*) FROM yuxi.events WHERE session_id = %s "
                              "AND type = 'tool.finished'", (session.id,))


async def _saved_on(pool, session, channel: str) -> int:
    """How many checkpoint writes of `session`'s thread are on `channel`."""
    return await scalar(pool, "SELECT count(*) FROM langgraph.checkpoint_writes "
                              "WHERE thread_id = %s AND channel = %s",
                        (str(session.id), channel))


async def test_a_waits_interrupt_goes_with_the_suspension(pool, checkpoint_pool, alice, writes):
    await _waiting_parent(pool, checkpoint_pool, alice[1])
    # The create's step with its tool.started | its result with the step
    # that applied it | the model's writes and its step with the wait's
    # tool.started | the wait's interrupt with the suspension (no write of
    # its own before it).
    assert writes == ["8 with tool.started", 3, "3 with tool.started",
                      "1 with suspension"], writes


async def test_a_run_cut_off_as_it_suspends_waits_again(pool, checkpoint_pool, alice,
                                                       monkeypatch):
    # The connection dies as the wait's interrupt and the suspension go out:
    # neither is there; the next run of the turn calls the wait again (no
    # effect is made twice), and the child's end answers it.
    scope = alice[1]
    session = await new_session(pool, scope, WAITS_FOR_A_CHILD)
    receipt = await sessions.receive_input(pool, scope, session.id, content="wake")
    (run_id,) = await runs_with_status(pool, "ready")
    original = _cut_off_at(monkeypatch, "suspend_run", held=True)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(run_id) \
        == "infra_fault"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.waits") == 0
    assert await _saved_on(pool, session, "__interrupt__") == 0
    monkeypatch.setattr(RunSaver, "write_with", original)
    await _woken_after_recovery(pool, checkpoint_pool, scope, receipt, run_id)
    assert await _children(pool) == 1


async def test_a_run_cut_off_as_its_tool_step_is_saved_calls_again_without_a_second_effect(
        pool, checkpoint_pool, alice, monkeypatch):
    # The connection dies as the create's result and the step that applied
    # it go out: neither is there, as if it died during the call; the next
    # run calls create_session again, which finds its effect: one child.
    scope = alice[1]
    session = await new_session(pool, scope, WAITS_FOR_A_CHILD)
    receipt = await sessions.receive_input(pool, scope, session.id, content="wake")
    (run_id,) = await runs_with_status(pool, "ready")
    original = RunSaver.aput

    async def cut_off(self, *args, **kwargs):
        if self._step_ended and self._held:  # a tool step's writes, held
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(RunSaver, "aput", cut_off)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(run_id) \
        == "infra_fault"
    assert await _children(pool) == 1
    assert await _tools_finished(pool, session) == 0
    monkeypatch.setattr(RunSaver, "aput", original)
    await _woken_after_recovery(pool, checkpoint_pool, scope, receipt, run_id)
    assert await _children(pool) == 1
    assert await _tools_finished(pool, session) == 2
    assert [m["role"] for m in await conversation.messages(checkpoint_pool, session.id)] == [
        "human", "ai", "tool", "ai", "tool", "ai"]


async def test_a_resumed_runs_answer_goes_with_the_waits_result(pool, checkpoint_pool, alice,
                                                               writes):
    scope = alice[1]
    session, receipt, resumed = await _resumed_parent(pool, checkpoint_pool, scope)
    writes.clear()
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(resumed) \
        == "completed"
    # The answer to the interrupt with the wait's result and the step that
    # applied it (the wait's tool.started is not sent again:
    # EventReporter.started_before) | the model's writes and its step with
    # the completion: two round trips.
    assert writes == [4, "3 with completion"], writes
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke: completed")


async def test_a_resumed_run_cut_off_as_its_answer_goes_out_is_resumed_again(
        pool, checkpoint_pool, alice, monkeypatch):
    # The connection dies as the answer to the interrupt and the wait's
    # result go out: neither is there; the next run of the turn gets the
    # same answer (the run's resume) and the turn ends as it would have.
    scope = alice[1]
    session, receipt, resumed = await _resumed_parent(pool, checkpoint_pool, scope)
    # The answer to the interrupt is held for the result.
    original, cut = _cut_off_held_write(monkeypatch, close=True)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(resumed) \
        == "infra_fault"
    assert cut == [4]
    assert await _saved_on(pool, session, "__resume__") == 0
    assert await _tools_finished(pool, session) == 1  # the create's; not the wait's
    monkeypatch.setattr(RunSaver, "_write", original)
    await _woken_after_recovery(pool, checkpoint_pool, scope, receipt, resumed)
