"""Execute one run: take its lease, drive the graph from the last checkpoint,
heartbeat, and end the run in one fenced transaction.

The worker keeps nothing that is not in PostgreSQL: the checkpoint holds the
turn's conversation (earlier turns are in yuxi.conversation), the run row
holds the lease and the outcome. Killed at any
instant, the run's lease expires and a new run of the same turn continues
from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, NamedTuple

import msgspec
import psycopg

from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, SystemMessage
from langgraph.errors import GraphRecursionError
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.types import Command
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.errors import LeaseLost, SandboxElsewhere, YuxiError, is_connection_error
from yuxi.runtime.calls import CallPolicy
from yuxi.runtime.graph import build_graph, set_history, started_before
from yuxi.runtime.group_commit import GroupCommit
from yuxi.runtime.live import CallCancelled, WorkerListener, DeltaBatcher
from yuxi.runtime.models import build_chat_model
from yuxi.runtime.providers import configured_providers
from yuxi.runtime.saver import LATEST_OF_RUN, RunSaver, unmark, unmarked_after
from yuxi.runtime import confine, cooperation, questions, sandbox_tools  # noqa: F401  (tool registration)
from yuxi.runtime.tools import ToolContext, available_tools
from yuxi.services import conversation, resources, runs, sandbox
from yuxi.settings import Settings

log = logging.getLogger(__name__)


def message_event(message: AIMessage) -> tuple[str, dict[str, Any], str]:
    """The `message` event of a model answer: (type, data, dedupe key suffix)."""
    return ("message",
            {"message_id": message.id, "role": "ai", "content": message.content,
             "tool_calls": [{"id": c["id"], "name": c["name"], "args": c["args"]}
                            for c in message.tool_calls]},
            f"message:{message.id}")


class EventReporter:
    """Records what the graph does as fenced events. Dedupe keys make a step
    re-executed after a crash report its fact once.

    A final answer (no tool calls) is not reported here: its `message` event
    commits with the completion (`RunExecutor` passes it to `complete`), one
    transaction less per turn; a run recovered after its final checkpoint
    reports it then. With the run's `saver`, an answer with tool calls waits
    too: its event goes with the saver's next write (`RunSaver.along`), the
    one that carries the answer's step and the calls' `tool.started` before
    any tool runs (RunSaver holds the step for it)."""

    def __init__(self, pool: AsyncConnectionPool, run_id: uuid.UUID, token: uuid.UUID,
                 turn_id: uuid.UUID, deltas: DeltaBatcher | None = None,
                 saver: Any = None) -> None:
        self.pool, self.run_id, self.token, self.turn_id = pool, run_id, token, turn_id
        self.deltas = deltas
        self.saver = saver
        # Ended calls whose tool.finished waits for the saver's next write.
        self._finished: list[tuple[dict[str, Any], str]] = []
        # Calls started and not ended: a step's calls all start before any
        # of them runs (group commit), so the one ending at 0 is its last.
        self._running = 0
        self._starts = GroupCommit(self._start_calls)
        self._finishes = GroupCommit(self._finish_calls)
        # Wait calls a resume re-executes (started_before).
        self._resumed: set[str] = set()

    async def _emit(self, type_: str, data: dict[str, Any], key: str) -> None:
        await runs.emit(self.pool, self.run_id, self.token, type_, data, f"{self.turn_id}:{key}")

    async def delta(self, message_id: str, text: str) -> None:
        """Ephemeral text of a streaming answer (NOTIFY only, no table)."""
        if self.deltas is not None:
            await self.deltas.add(message_id, text)

    async def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        async with self.pool.connection() as conn:
            with db.domain_errors():
                await db.execute(conn, "add_run_usage", {
                    "run_id": self.run_id, "token": self.token, "prompt": prompt_tokens,
                    "completion": completion_tokens})

    async def message(self, message: AIMessage) -> None:
        # Deltas go out before the durable message that holds them all.
        if self.deltas is not None:
            await self.deltas.flush()
        if message.tool_calls:
            type_, data, key = message_event(message)
            if self.saver is None:
                await self._emit(type_, data, key)
                return
            params = runs.emit_params(self.run_id, self.token, type_, data,
                                      f"{self.turn_id}:{key}")
            self.saver.along(lambda: (db.QUERIES["emit_run_event"], params))

    async def tool_started(self, call: dict[str, Any]) -> None:
        """The call's `tool.started`, or TurnCancelled when a cancel intent
        was committed (checked before each tool call, in the same statement;
        a step's parallel calls go in one: yuxi.runtime.group_commit). Not
        for a wait call a resume re-executes: its start is recorded already
        (started_before)."""
        self._running += 1
        if call["id"] in self._resumed:
            self._resumed.discard(call["id"])
            return
        try:
            if not await self._starts.submit(call):
                raise TurnCancelled(f"turn {self.turn_id} was cancelled")
        except BaseException:
            self._running -= 1  # the call does not run
            raise

    def started_before(self, call_ids: list[str]) -> None:
        """Wait calls that a resume re-executes from their start: each one's
        `tool.started` committed before the call ran and suspended, and a
        wait has no effect, so it runs again without that round trip (which
        would record nothing: its dedupe key) and without a check of its own
        for a cancel. The resume's lease checked for one an instant before;
        one committed since is met at the completion, or at once by a real
        model's call (RunExecutor._watched_turn). Calls that act after an
        approval keep their check: only wait interrupts name calls here
        (resumed_waits)."""
        self._resumed.update(call_ids)

    async def tool_finished(self, call: dict[str, Any], result: str) -> None:
        self._running -= 1
        if self.saver is None:
            await self._finishes.submit((call, result))
            return
        if self._running == 0:
            # Nothing of the step runs any more: this call's result goes
            # with the step's checkpoint (RunSaver.last_call_ended).
            self.saver.last_call_ended()
        # With the run's saver: the event goes with the tool's result, the
        # saver's next write (LangGraph saves the result at once, so no
        # later than that), in one transaction; the calls that end together
        # share one statement.
        if not self._finished:
            self.saver.along(self._finished_statement)
        self._finished.append((call, result))

    def _finished_statement(self) -> tuple[str, dict[str, Any]] | None:
        finished, self._finished = self._finished, []
        return (db.QUERIES["emit_run_events"], self._finished_params(finished)) if finished \
            else None

    def _finished_params(self, finished: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
        return {"run_id": self.run_id, "token": self.token, "type": "tool.finished",
                "events": Jsonb([
                    {"data": {"call_id": c["id"], "tool": c["name"], "result": result},
                     "dedupe_key": f"{self.turn_id}:tool.finished:{c['id']}"}
                    for c, result in finished])}

    async def _start_calls(self, calls: list[dict[str, Any]]) -> list[bool]:
        params = {"run_id": self.run_id, "token": self.token, "events": Jsonb([
            {"data": {"call_id": c["id"], "tool": c["name"], "args": c.get("args") or {}},
             "dedupe_key": f"{self.turn_id}:tool.started:{c['id']}"} for c in calls])}
        # With what the saver holds: the step that asked for the calls.
        row = await runs.fetch_one_after_held(self.pool, self.saver, "start_tool_calls", params)
        return [row["started"]] * len(calls)

    async def _finish_calls(self, finished: list[tuple[dict[str, Any], str]]) -> list[None]:
        async with self.pool.connection() as conn:
            await db.execute(conn, "emit_run_events", self._finished_params(finished))
        return [None] * len(finished)


def steer_message(input_id: uuid.UUID | str, content: str) -> HumanMessage:
    return HumanMessage(content=content, id=f"input:{input_id}",
                        additional_kwargs={"yuxi": {"steer": True, "input_id": str(input_id)}})


def cooperation_message(row: dict[str, Any]) -> HumanMessage:
    # Cooperation text is context, never the user's authorization.
    return HumanMessage(
        content=f"[cooperation message from {row['sender_path']} "
                f"(session {row['sender_session_id']})]\n{row['content']}",
        id=f"message:{row['id']}",
        additional_kwargs={"yuxi": {"message_id": str(row["id"]),
                                    "from": str(row["sender_session_id"])}})


class SteerInbox:
    """What reaches the run's conversation at a safe boundary: steers of its
    turn and cooperation messages to its session not yet in it, oldest first."""

    def __init__(self, pool: AsyncConnectionPool, run: dict[str, Any], token: uuid.UUID,
                 *, first_checked: bool = False) -> None:
        self.pool, self.run, self.token = pool, run, token
        # The lease was taken an instant ago by a transaction that found
        # nothing waiting (`boundary_pending`): the first boundary is passed.
        # What commits in between is met at completion (cancel, steer) or at
        # the next boundary.
        self.first_checked = first_checked

    async def take(self, messages: list[Any]) -> list[HumanMessage]:
        """Raises TurnCancelled when a cancel intent was committed."""
        if self.first_checked:
            self.first_checked = False
            return []
        present = {m.id for m in messages}
        rows = await runs.boundary(self.pool, self.run)
        if any(r["kind"] == "cancel" for r in rows):
            raise TurnCancelled(f"turn {self.run['turn_id']} was cancelled")
        steers = [steer_message(r["id"], r["content"]) for r in rows
                  if r["kind"] == "steer" and f"input:{r['id']}" not in present]
        notes = [cooperation_message(r) for r in rows
                 if r["kind"] == "message" and f"message:{r['id']}" not in present]
        if steers:
            await runs.mark_steers_delivered(
                self.pool, self.run["id"], self.token,
                [uuid.UUID(m.id.removeprefix("input:")) for m in steers])
        if notes:
            await runs.mark_messages_processed(
                self.pool, self.run["id"], self.token,
                [uuid.UUID(m.id.removeprefix("message:")) for m in notes])
        return notes + steers


def delivered_steers(messages: list[Any], input_id: str) -> list[uuid.UUID]:
    """Steer inputs the turn's conversation holds (after its first input)."""
    start = next(i for i, m in enumerate(messages) if m.id == input_id)
    return [uuid.UUID(m.id.removeprefix("input:")) for m in messages[start + 1:]
            if isinstance(m, HumanMessage) and (m.id or "").startswith("input:")]


def identity_message(run: dict[str, Any]) -> SystemMessage:
    """The session's identity, loaded once per run and given to every model
    call of the run (never stored in the conversation)."""
    parent = run["session_parent_id"] or "none (root session)"
    text = (f"You are Yuxi session '{run['session_name']}' at path {run['session_path']} "
            f"(session id {run['session_id']}, parent {parent}, tree {run['tree_id']}, "
            f"run {run['id']}).")
    if run["session_parent_id"]:
        text += (" You were created by your parent session to do the task in your first "
                 "input: deliver that task first; do not act as the orchestrator of the "
                 "parent's work.")
    return SystemMessage(content=text, id=f"identity:{run['id']}")


def selected_tools(config: dict[str, Any]) -> list[str]:
    """Tool names of a config; "cooperation" stands for the eight tools."""
    names: list[str] = []
    for name in config.get("tools", []):
        names.extend(cooperation.COOPERATION_TOOLS if name == "cooperation" else [name])
    return list(dict.fromkeys(names))


def input_message(run: dict[str, Any]) -> HumanMessage:
    return HumanMessage(
        content=run["input_content"],
        id=f"input:{run['input_id']}",
        additional_kwargs={"yuxi": {"turn_start": True, "turn_id": str(run["turn_id"]),
                                    "input_id": str(run["input_id"])}},
    )


def final_answer(messages: list[Any], input_id: str) -> AIMessage:
    """The turn's final answer: the last AI message after its input."""
    start = next(i for i, m in enumerate(messages) if m.id == input_id)
    for message in reversed(messages[start:]):
        if isinstance(message, AIMessage):
            return message
    raise RuntimeError("the turn ended without an answer")


class MaxStepsExceeded(YuxiError):
    """The turn made more model and tool steps than its config's max_steps."""

    code = "max_steps_exceeded"


class TurnCancelled(Exception):
    """A cancel intent for the turn was committed: stop at this boundary."""


class Suspended(Exception):
    """The graph stopped at interrupts (wait tools, approvals, questions)."""

    def __init__(self, interrupts: list[Any]) -> None:
        super().__init__("suspended")
        self.interrupts = interrupts

    def user_request(self) -> tuple[str, dict[str, Any]] | None:
        """What to ask the user, if any interrupt is for the user."""
        approvals = [{**i.value, "interrupt_id": i.id} for i in self.interrupts
                     if i.value.get("kind") == "approval"]
        questions = [{**q, "interrupt_id": i.id} for i in self.interrupts
                     if i.value.get("kind") == "questions" for q in i.value["questions"]]
        if approvals:
            return "approval", {"approvals": [{k: a[k] for k in ("call_id", "tool", "args",
                                                                 "interrupt_id")}
                                              for a in approvals], "questions": questions}
        if questions:
            return "questions", {"questions": questions}
        return None

    def cooperation_wait(self) -> dict[str, Any]:
        return next(i.value for i in self.interrupts
                    if i.value.get("kind") in cooperation.WAIT_KINDS)


def resumed_waits(interrupts: list[Any]) -> list[str]:
    """The wait calls that answering these interrupts re-executes (their
    interrupts name them; one saved before they did names none)."""
    return [i.value["call_id"] for i in interrupts
            if i.value.get("kind") in cooperation.WAIT_KINDS and i.value.get("call_id")]


class TurnConversation:
    """The conversation a run's model sees: the archive of earlier turns
    (yuxi.conversation), loaded once per run, then the checkpoint's messages.
    A turn's checkpoint starts with its input alone: what an earlier turn
    left there is archived first (fenced by the lease, idempotent), then the
    turn's first checkpoint forgets it (`RESET`).

    A completed turn's messages are archived by its completion
    (complete_run_v1); the next turn's first run finds them archived and
    only drops them from the checkpoint.

    `carry` is what the same worker knows from the session's previous turn
    when that turn's completion handed this run over (no other writer could
    run in between): its history and final messages, which are exactly the
    archive and the checkpoint now; the run then reads and writes neither."""

    def __init__(self, conn: psycopg.AsyncConnection, run: dict[str, Any],
                 token: uuid.UUID, carry: Carry | None = None,
                 archive: list[dict[str, Any]] | None = None, after: int = 0) -> None:
        self.conn, self.run, self.token, self.carry = conn, run, token, carry
        # What this process decoded of the session's archive already.
        self.cache = (conversation.ARCHIVE, run["session_id"])
        self.loaded = False
        self.history: list[Any] = []
        # The archive's rows, read with the checkpoint (earlier_messages), or
        # with the lease (`archive`, with the checkpoint the saver knows).
        self._archive: list[dict[str, Any]] | None = archive
        # The position `_archive` starts after (what the cache held when the
        # lease read it).
        self._after = after
        # The checkpoint's messages when the graph last returned.
        self.final: list[Any] = []

    async def earlier_messages(self, graph: Any, cfg: dict[str, Any]) -> list[Any] | None:
        """The messages the latest checkpoint holds (read without building a
        state snapshot: the turn's input is known not to be among them);
        None when the thread has no checkpoint (nothing ran in the session,
        so nothing is archived either)."""
        if self.carry is not None:
            return list(self.carry.messages)
        config = {"configurable": {**cfg["configurable"], "checkpoint_ns": ""}}
        saver = graph.checkpointer
        if isinstance(saver, RunSaver):
            known, found = saver.known_latest(config)
            if not known or self._archive is None:  # both, in one round trip
                # Past what this process holds decoded of the archive.
                self._after = self.cache[0].known(self.cache[1])
                found, self._archive = await saver.aget_tuple_with(
                    config, db.QUERIES["conversation_history"],
                    {"run_id": self.run["id"], "after": self._after})
        else:
            found = await saver.aget_tuple(config)
        return list(found.checkpoint["channel_values"].get("messages", [])) if found else None

    async def load(self, graph: Any, earlier: list[Any] | None = ()) -> None:
        """Archive `earlier` (messages of earlier turns still in the
        checkpoint; must commit before the checkpoint that drops them), then
        give the graph the history, once per run."""
        if self.loaded and not earlier:
            return
        if earlier is None:  # no checkpoint: a session's first turn
            self.history = []
        elif self.carry is not None and earlier:
            # Archived by the completion that handed this run over.
            self.history = [*self.carry.history, *earlier]
        elif self._archive is not None and (history := conversation.archived_history(
                self._archive, earlier or (), self.cache, self._after)) is not None:
            # Archived by the completion of their turn (read with them).
            self.history = history
        else:
            self.history = await conversation.archive_and_load(
                self.conn, self.run["id"], self.token, earlier or (), self.cache)
        self._archive = None
        set_history(graph, self.history)
        self.loaded = True


class Carry(NamedTuple):
    """A completed turn's conversation, for the run its completion handed
    over: the archive the run saw, the messages its checkpoint ends with,
    and that checkpoint as LangGraph reads it (RunSaver.latest_tuple)."""

    history: list[Any]
    messages: list[Any]
    checkpoint: Any = None


# Where a handed-over run's dict holds its Carry.
CARRY = "_conversation"


class LeaseReads(NamedTuple):
    """What a run reads first, read in its lease's round trip
    (runs.start_run_reading): its thread's latest checkpoint (a row of
    LATEST_OF_RUN, or None) and its session's archive past position `after`
    (what this process holds of it: conversation.ARCHIVE)."""

    checkpoint: dict[str, Any] | None
    archive: list[dict[str, Any]] | None
    after: int = 0


# Where a run's dict holds its LeaseReads.
READ = "_read"


def lease_reads(run_id: uuid.UUID, after: int = 0) -> list[tuple[str, Any]]:
    return [(LATEST_OF_RUN, (run_id,)),
            (db.QUERIES["conversation_history"], {"run_id": run_id, "after": after})]


def carried_checkpoint(run: dict[str, Any]) -> Any:
    carry = run.get(CARRY)
    return carry.checkpoint if carry is not None else None


# Put first in a turn's input: the checkpoint's messages start over with it.
RESET = RemoveMessage(id=REMOVE_ALL_MESSAGES)


async def drive(graph: Any, cfg: dict[str, Any], run: dict[str, Any],
                extra: list[Any] = (), resume: dict[str, Any] | None = None, *,
                conv: TurnConversation) -> tuple[AIMessage, list[uuid.UUID]]:
    """Run the graph from wherever the checkpoint says this turn is; `extra`
    messages (late steers) start one more model call of a finished turn;
    `resume` answers the pending interrupt of a suspended one. Returns the
    turn's final answer and the steers its conversation holds; raises
    Suspended when a wait tool interrupted the graph."""
    first = input_message(run)
    if run["attempt"] == 1 and not run.get("resume") and not extra and resume is None:
        # The first run of a turn, at its start: its input cannot be in the
        # checkpoint yet (after a crash the turn goes on in a run with
        # attempt > 1), so all the checkpoint holds is earlier turns'. (A
        # first run whose wait was met as it suspended goes on from the wait.)
        await conv.load(graph, await conv.earlier_messages(graph, cfg))
        values = await graph.ainvoke({"messages": [RESET, first]}, cfg, durability="sync")
    else:
        state = await graph.aget_state(cfg)
        messages = state.values.get("messages", []) if state.values else []
        values = state.values
        fresh = not any(m.id == first.id for m in messages)
        # Without its input, the checkpoint holds earlier turns' messages
        # only (a first run cut off before its first checkpoint).
        await conv.load(graph, messages if fresh else ())
        if fresh:
            values = await graph.ainvoke({"messages": [RESET, first, *extra]}, cfg,
                                         durability="sync")
        elif state.next and state.interrupts:
            if not resume:
                # A run recovered after its wait's interrupt was saved but
                # before the wait was (its worker died in between): it waits
                # now, as that run would have. Resumed with nothing to say,
                # a wait tool would answer before its condition holds.
                raise Suspended(list(state.interrupts))
            if resume.get("answer"):
                # The user's answers, by interrupt id (approvals, questions).
                command = Command(resume=resume["answer"])
            else:
                command = Command(resume=resume)
            started_before(graph, resumed_waits(state.interrupts))
            values = await graph.ainvoke(command, cfg, durability="sync")
        elif state.next or state.tasks:
            # `tasks` without `next`: a step's tasks finished and their writes
            # are saved, but the step's checkpoint was not (the run was cut
            # off in between, e.g. by a database restart). The live state
            # shows those writes (the input, a model answer with tool calls),
            # yet the graph has not gone on from them: go on, never take
            # that view for the end of the turn.
            values = await graph.ainvoke(None, cfg, durability="sync")
        elif extra:
            values = await graph.ainvoke({"messages": list(extra)}, cfg, durability="sync")
        elif state.interrupts:
            raise Suspended(list(state.interrupts))
    if values.get("__interrupt__"):
        raise Suspended(list(values["__interrupt__"]))
    messages = values["messages"]
    conv.final = messages
    return final_answer(messages, first.id), delivered_steers(messages, first.id)


# A worker goes on with a run its completion gave a slot to (leased to it in
# the completing transaction, without a job: the tree's next pending run, the
# parent its turn's end woke, its session's next queued turn). While the
# process has a free slot, going on keeps no queued job waiting (the process
# could take it all the same), so it is not counted: a fan-out's slot goes
# from child to child without a break. Gone on this many times while the
# process was full, it leaves the next run to the queue: a busy tree holds
# one worker slot for a bounded time while other trees' jobs wait. 0: never
# go on. A stopping worker goes on with none (`_next_token`): it exits once
# its runs in flight end, however long the chain they are part of.
MAX_CONTINUED_RUNS = 8

# How long a worker tries to report that a run was cut off by the database
# (an outage of up to two minutes, and some).
INFRA_REPORT_SECONDS = 180.0

Next = tuple[dict[str, Any], uuid.UUID]  # a leased next run and its token


def _calling(saver: Any, in_flight: Any) -> Any:
    """How the run's model calls are made: abortable (`in_flight`, a real
    model), and with the saver's held start of the turn sent meanwhile when
    the call takes a while (RunSaver.during_model_call)."""
    hold = getattr(saver, "during_model_call", None)
    if hold is None:
        return in_flight
    if in_flight is None:
        return hold
    return lambda call: hold(in_flight(call))


class RunExecutor:
    def __init__(self, settings: Settings, pool: AsyncConnectionPool,
                 checkpoint_pool: AsyncConnectionPool, *,
                 max_continued_runs: int = MAX_CONTINUED_RUNS) -> None:
        self.settings = settings
        self.pool = pool
        self.checkpoint_pool = checkpoint_pool
        self.max_continued_runs = max_continued_runs
        self.jail = confine.for_settings(settings)
        # yuxi.metrics.WorkerMetrics when this worker exposes metrics.
        self.metrics: Any = None
        # The process's LISTEN on cancel notifications, started by the first
        # run of a real model (the replay model stops at boundaries), and on
        # ready runs when the worker claims them (`claims`).
        # (A LISTEN needs a session: the server itself behind a pooler.)
        self.listener = WorkerListener(settings.session_database_url if settings.pooled
                                       else pool.conninfo)
        # The process's runs at once, whether a job or a claim brought them
        # (YUXI_WORKER_CONCURRENCY).
        self.slots = asyncio.Semaphore(settings.worker_concurrency)
        self.stopping = False
        self._claims: set[asyncio.Task[Any]] = set()

    def claims(self, queues: tuple[str, ...]) -> None:
        """Claim ready runs of `queues` as they are deferred (`yuxi_ready`),
        while this process has a free slot: their jobs are then removed,
        never fetched (claim_run_v1). Without a free slot the job stays for
        whichever worker fetches it first. Of several claiming workers, the
        one the run is announced to claims it (WorkerListener.picked)."""
        def on_ready(payload: str) -> None:
            try:
                queue, run_id, job_id, session_id, claimer = payload.split()
                run, job, session = uuid.UUID(run_id), int(job_id), uuid.UUID(session_id)
                picked = int(claimer)
            except ValueError:
                log.warning("ignoring a malformed yuxi_ready payload %r", payload[:200])
                return
            if queue not in queues or self.slots.locked() \
                    or not self.listener.picked(picked):
                return
            task = asyncio.create_task(self._claimed(run, job, session),
                                       name=f"yuxi-claim-{run}")
            self._claims.add(task)
            task.add_done_callback(self._claims.discard)

        self.listener.claimer_host = self.settings.host_id
        self.listener.on_ready = on_ready
        self.listener.start()

    async def _claimed(self, run_id: uuid.UUID, job_id: int, session_id: uuid.UUID) -> None:
        if self.slots.locked():
            # Taken meanwhile (a burst of announcements): no waiting for a
            # slot, the job is there for that. (From here to taking the slot
            # in `execute` nothing awaits: no other task runs in between.)
            return
        try:
            outcome = await self.execute(run_id, job_id=job_id, session_id=session_id)
        except Exception:
            # Its lease expires and the recovery sweep retries it.
            log.exception("claimed run %s", run_id)
            return
        if outcome != "skipped":
            log.info("run %s (claimed): %s", run_id, outcome)

    def stop_claims(self) -> asyncio.Task | None:
        """Claim no more; returns the claims' listening task, cancelled."""
        self.stopping = True  # the runs in flight finish; nothing follows them
        return self.listener.stop_claiming()

    async def close_claims(self) -> None:
        """Claim no more, and let the claimed runs in flight finish (as a
        stopping worker's jobs do; a run cut off by a kill is recovered when
        its lease expires). The claims' LISTEN connection is closed on
        return."""
        stopped = self.stop_claims()
        await asyncio.gather(*self._claims, *([stopped] if stopped else []),
                             return_exceptions=True)

    async def execute(self, run_id: uuid.UUID, *, job_id: int | None = None,
                      session_id: uuid.UUID | None = None) -> str:
        """Execute a run, then the runs handed over to this worker when a run
        completed (bounded by max_continued_runs while the process is full;
        sql/020_slots.sql). Returns what happened to the last one: skipped
        (not ready: a stale or duplicate job, or a run another worker
        claimed), completed, suspended, cancelled,
        failed, or lease_lost (then the worker changed nothing). `job_id`: a
        claim (`claims`), which removes the run's job with the lease.
        `session_id`, when known (a claim's announcement), lets the lease's
        round trip read only what this process does not hold of the
        session's archive."""
        async with self.slots:
            return await self._execute(run_id, job_id, session_id)

    async def _execute(self, run_id: uuid.UUID, job_id: int | None,
                       session_id: uuid.UUID | None = None) -> str:
        token = uuid.uuid4()
        after = conversation.ARCHIVE.known(session_id) if session_id else 0
        # One checkpoint connection for the job's runs: taking a lease on it
        # marks it for the checkpointer (start_run_v1, complete_run_v1).
        async with self.checkpoint_pool.connection() as conn:
            try:
                # With what the run reads first: one round trip for both.
                run, (latest, archive) = await runs.start_run_reading(
                    conn, run_id, token, self.settings.lease_seconds, lease_reads(run_id, after),
                    mark=True, host=self.settings.host_id, job_id=job_id,
                    claimer=self.listener.claimer)
            except BaseException:
                await unmark(conn)  # whether or not the lease committed
                raise
            if run is None:
                # Not taken, not marked (a claim another worker won, a stale
                # job): the connection goes back as it came, no round trip.
                return "skipped"
            run[READ] = LeaseReads(latest[0] if latest else None, archive, after)
            outcome: str | None = None
            async with unmarked_after(conn, unless=lambda: outcome == "completed"):
                left = self.max_continued_runs
                while True:
                    outcome = None  # until this run's own outcome
                    outcome, following = await self._measured(run, token, conn, left > 0)
                    if following is None:
                        # A completion with no run to go on with unmarked
                        # the connection as it committed (complete_run_v1).
                        return outcome
                    log.debug("run %s: %s; going on with run %s", run["id"], outcome,
                              following[0]["id"])
                    if self.slots.locked():
                        left -= 1  # a queued job may wait for this slot
                    run, token = following

    async def _measured(self, run: dict[str, Any], token: uuid.UUID,
                        conn: psycopg.AsyncConnection, go_on: bool) -> tuple[str, Next | None]:
        if self.metrics is None:
            return await self._execute_leased(run, token, conn, go_on)
        self.metrics.run_started(run)
        began = time.monotonic()
        outcome, following = await self._execute_leased(run, token, conn, go_on)
        self.metrics.run_ended(outcome, time.monotonic() - began)
        if outcome in ("completed", "failed", "cancelled"):
            try:
                await self.metrics.turn_maybe_ended(self.pool, run["turn_id"])
            except Exception:  # a figure is never worth failing work for
                log.exception("turn metrics of run %s", run["id"])
        return outcome, following

    async def _execute_leased(self, run: dict[str, Any], token: uuid.UUID,
                              conn: psycopg.AsyncConnection, go_on: bool,
                              ) -> tuple[str, Next | None]:
        """Execute a run whose lease this worker holds; with `go_on`, its
        completion may hand over a run it gives a slot to."""
        run_id = run["id"]
        deltas = DeltaBatcher(self.pool, run)
        work = asyncio.create_task(self._watched_turn(run, token, conn, go_on, deltas))
        keeper = asyncio.create_task(self._keep_lease(run_id, token))
        try:
            await asyncio.wait({work, keeper}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the lease was lost: stop, write nothing
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return "lease_lost", None
            keeper.cancel()
            try:
                return work.result()
            except LeaseLost:
                return "lease_lost", None
            except (TurnCancelled, CallCancelled):
                await runs.cancel_run(self.pool, run_id, token)
                return "cancelled", None
            except SandboxElsewhere:
                # Claimed before any model call: hand the run to the host
                # whose disk holds the tree's sandbox.
                queue = await runs.yield_run(self.pool, run_id, token)
                log.info("run %s: its tree's sandbox is live elsewhere; moved to %s",
                         run_id, queue)
                return "moved", None
            except Exception as exc:
                if isinstance(exc, psycopg.Error) and exc.sqlstate == "YX003":
                    return "lease_lost", None  # a checkpoint write met the fence
                if is_connection_error(exc):
                    # Not the model's fault: the turn goes on from its last
                    # checkpoint in a new run (recover_run_v1).
                    await self._report_infra_fault(run_id, token, exc)
                    return "infra_fault", None
                log.warning("run %s failed: %s", run_id, exc, exc_info=exc)
                error = (f"{exc.code}: {exc.message}" if isinstance(exc, YuxiError)
                         else f"{type(exc).__name__}: {exc}")
                await runs.fail(self.pool, run_id, token, error)
                return "failed", None
        except LeaseLost:
            return "lease_lost", None
        finally:
            for task in (work, keeper):
                task.cancel()
            await deltas.close()

    async def _watched_turn(self, run: dict[str, Any], token: uuid.UUID,
                            conn: psycopg.AsyncConnection, go_on: bool,
                            deltas: DeltaBatcher) -> tuple[str, Next | None]:
        """`_run_turn`, with its model calls abortable by a cancel
        notification when the model is a real one (the replay model stops at
        boundaries). Runs while the lease is kept."""
        provider = str(run["config"].get("model", "")).strip().partition("/")[0]
        if provider not in configured_providers():
            return await self._run_turn(run, token, conn, go_on, deltas=deltas)
        # A real model call can last minutes. Listening before the intent is
        # read again closes the gap since the lease was taken.
        await self.listener.ready()
        with self.listener.watch(run["turn_id"]) as watched:
            if await runs.cancel_requested(self.pool, run["turn_id"]):
                watched.cancelled = True
            return await self._run_turn(
                run, token, conn, go_on, deltas=deltas,
                in_flight=lambda call: self.listener.run(watched, call))

    async def _report_infra_fault(self, run_id: uuid.UUID, token: uuid.UUID,
                                  exc: BaseException) -> None:
        """A connection-level error cut the run off: it is left to its lease
        and marked, once the database answers again, as an infrastructure
        fault (its lease expires at once; recovery retries it without using
        up an attempt). Tried with backoff for up to INFRA_REPORT_SECONDS;
        if the report never lands, the lease expires all the same."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.warning("run %s: database connection lost (%s); left to its lease as an "
                    "infrastructure fault", run_id, reason)
        delay, deadline = 0.2, asyncio.get_running_loop().time() + INFRA_REPORT_SECONDS
        while True:
            try:
                await runs.report_infra_fault(self.pool, run_id, token,
                                              f"{type(exc).__name__}: {reason}")
                return
            except Exception as again:
                if not is_connection_error(again) or \
                        asyncio.get_running_loop().time() + delay > deadline:
                    log.warning("run %s: could not report the infrastructure fault: %s",
                                run_id, again)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _keep_lease(self, run_id: uuid.UUID, token: uuid.UUID) -> None:
        """Heartbeat until the lease is lost (then return)."""
        interval = self.settings.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            try:
                if not await runs.heartbeat(self.pool, run_id, token, self.settings.lease_seconds):
                    log.warning("run %s lost its lease", run_id)
                    return
            except Exception:  # a transient database error: try again
                log.exception("heartbeat of run %s failed", run_id)

    async def _run_turn(self, run: dict[str, Any], token: uuid.UUID,
                        conn: psycopg.AsyncConnection, go_on: bool, *,
                        deltas: DeltaBatcher | None = None, in_flight: Any = None,
                        ) -> tuple[str, Next | None]:
        """Drive the graph and complete the run; a steer that arrived while the
        model produced the final answer gets one more model call; a wait tool
        suspends the run (unless its condition already holds)."""
        # Visibility is resolved with the user's grants as they are now; an
        # explicitly selected resource that lost its grant fails the run
        # before any model call.
        selection = run["config"].get("resources") or []
        visible = (await resources.resolve(self.pool, run["user_id"], run["app_id"], selection)
                   if selection else [])
        resources.require_all_granted(visible)
        box = None
        if any(t.group == "sandbox" for t in available_tools(selected_tools(run["config"]),
                                                            visible).values()):
            # The run holds the tree's sandbox while it executes.
            box = msgspec.structs.replace(
                await sandbox.claim(self.pool, self.settings.data_dir, run["id"], token,
                                    run["tree_id"], host=self.settings.host_id), jail=self.jail)
        try:
            # `conn` is marked with this run's lease (by its start or by the
            # completion that handed it over).
            saver = RunSaver(conn, empty=bool(run.get("first_run")),
                             latest=carried_checkpoint(run))
            read = run.get(READ)
            if read is not None and not await saver.know_latest(str(run["session_id"]),
                                                               read.checkpoint):
                run[READ] = None
            return await self._drive_turn(run, token, visible, box, saver,
                                          go_on, deltas=deltas, in_flight=in_flight)
        finally:
            if box is not None:
                await sandbox.touch(self.pool, run["tree_id"])

    async def _drive_turn(self, run: dict[str, Any], token: uuid.UUID,
                          visible: list[resources.Resolved], box: Any, saver: Any,
                          go_on: bool = False, *, deltas: DeltaBatcher | None = None,
                          in_flight: Any = None) -> tuple[str, Next | None]:
        graph, cfg = self._graph(run, token, saver, visible, box, deltas=deltas,
                                 in_flight=in_flight)
        extra: list[Any] = []
        resume = run.get("resume")
        read = run.get(READ)
        conv = TurnConversation(saver.conn, run, token, run.get(CARRY),
                                archive=read.archive if read is not None else None,
                                after=read.after if read is not None else 0)
        while True:
            try:
                answer, delivered = await drive(graph, cfg, run, extra, resume, conv=conv)
            except GraphRecursionError:
                # The turn fails at its step limit: what waited for a next
                # step (an answer asking for tool calls, its event) is saved
                # first.
                await saver.write_held()
                raise MaxStepsExceeded(
                    f"the turn exceeded max_steps ({int(run['config'].get('max_steps', 25))})"
                ) from None
            except Suspended as stop:
                if (ask := stop.user_request()) is not None:
                    await runs.suspend_for_user(saver.conn, run["id"], token, *ask, saver=saver)
                    return "suspended", None
                wait = stop.cooperation_wait()
                # On the checkpoint connection, as a completion: the slot it
                # releases may come back as the run to go on with.
                next_token = self._next_token(go_on)
                outcome, following = await runs.suspend(
                    saver.conn, run["id"], token, wait["kind"],
                    [uuid.UUID(t) for t in wait["targets"]], wait["cursor"], wait["timeout_s"],
                    next_token=next_token, lease_seconds=self.settings.lease_seconds,
                    mark=True, saver=saver)
                if outcome == "suspended":
                    return outcome, (following, next_token) if following else None
                resume, extra = {"reason": outcome}, []  # ready or cycle: answer at once
                continue
            except Exception as exc:
                # The run fails or is cancelled here: what is held was so (the
                # turn's start, when the model failed at once) and is saved
                # first, as a slower failure would have found it saved: the
                # conversation holds the failed turn's input. (Not when the
                # lease or the database is gone: as if the worker died.)
                if not isinstance(exc, LeaseLost) and not is_connection_error(exc):
                    with contextlib.suppress(Exception):
                        await saver.write_held()
                raise
            next_token = self._next_token(go_on)
            type_, data, key = message_event(answer)
            # On the checkpoint connection: nothing else uses it now, and a
            # handed-over run's mark goes with the same transaction.
            outcome, following = await runs.complete(
                saver.conn, run["id"], token, {"text": answer.text, "message_id": answer.id},
                delivered, next_token=next_token, lease_seconds=self.settings.lease_seconds,
                events=[{"type": type_, "data": data,
                         "dedupe_key": f"{run['turn_id']}:{key}"}], mark=True,
                archive=conversation.archive_params(conv.final), saver=saver)
            if outcome != "steer":
                if following and following["session_id"] == run["session_id"]:
                    # The session's next turn (a hand-over may also give
                    # the slot to another session's run: that one reads
                    # its own session's archive).
                    following = {**following, CARRY: Carry(conv.history, conv.final,
                                                           saver.latest_tuple())}
                return outcome, (following, next_token) if following else None
            resume = None
            extra = await SteerInbox(self.pool, run, token).take(
                (await graph.aget_state(cfg)).values["messages"])

    def _next_token(self, go_on: bool) -> uuid.UUID | None:
        """The token a run handed over at this completion (or suspension)
        is leased with, or None: no hand-over. Asked at the completion, not
        at the run's start: a worker told to stop while the run was in
        flight takes nothing on; the run its completion gives a slot to gets
        a job in that transaction, for another worker."""
        return uuid.uuid4() if go_on and not self.stopping else None

    def _graph(self, run: dict[str, Any], token: uuid.UUID, saver: Any,
               visible: list[resources.Resolved] = (), box: Any = None, *,
               deltas: DeltaBatcher | None = None, in_flight: Any = None,
               ) -> tuple[Any, dict[str, Any]]:
        config = run["config"]
        session = {"id": str(run["session_id"]), "name": run["session_name"],
                   "path": run["session_path"],
                   "parent_id": str(run["session_parent_id"] or "") or None,
                   "tree_id": str(run["tree_id"])}
        model = build_chat_model(config["model"], config,
                                 approval_mode=config.get("approval_mode", "auto"),
                                 session=session, timeout=self.settings.model_timeout_seconds)
        provider_name = config["model"].strip().partition("/")[0]
        provider = configured_providers().get(provider_name)
        policy = CallPolicy(provider=provider_name,
                            max_attempts=self.settings.model_max_attempts,
                            backoff_seconds=self.settings.model_backoff_seconds,
                            timeout_seconds=self.settings.model_timeout_seconds,
                            secrets=(provider.api_key(),) if provider else (),
                            require_finish=provider is not None)
        preamble = [identity_message(run)]
        if config.get("system_prompt"):
            preamble.append(SystemMessage(content=config["system_prompt"], id="system"))
        tools = available_tools(selected_tools(config), list(visible))
        reporter = EventReporter(self.pool, run["id"], token, run["turn_id"], deltas, saver)
        creates = cooperation.create_batch(self.pool, run["id"], token, run["config"])
        graph = build_graph(model, tools, reporter, preamble=preamble,
                            checkpointer=saver,
                            inbox=SteerInbox(self.pool, run, token, first_checked=not run.get(
                                "boundary_pending", True)),
                            tool_context=lambda call_id, cursors, waits_in_step: ToolContext(
                                pool=self.pool, run_id=run["id"], token=token,
                                call_id=call_id, visible=tuple(visible), run=run,
                                cursors=cursors, waits_in_step=waits_in_step,
                                default_model=self.settings.default_model, sandbox=box,
                                creates=creates),
                            policy=policy, in_flight=_calling(saver, in_flight))
        cfg = {"configurable": {"thread_id": str(run["session_id"])},
               "recursion_limit": 2 * int(config.get("max_steps", 25)) + 2}
        if self.metrics is not None:
            from yuxi.metrics import ModelCallMetrics

            cfg["callbacks"] = [ModelCallMetrics(self.metrics)]
        return graph, cfg
