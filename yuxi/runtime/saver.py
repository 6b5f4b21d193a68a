"""The checkpointer of an executing run, fenced by the run's lease.

A worker's job borrows one connection of the checkpoint pool for its runs
and marks it with the executing run's id and lease token (session settings;
start_run_v1 and complete_run_v1 do it in the transaction that takes the
lease). Triggers on LangGraph's tables (sql/110_checkpoint_fence.sql) check
the lease in each transaction that writes, so a worker that lost its lease
changes nothing, and a recovery waits for a write in flight instead of
interleaving with it. The writes themselves stay in psycopg's pipeline
mode: the fence costs no round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import psycopg
from langgraph.checkpoint.base import (
    INTERRUPT, RESUME, WRITES_IDX_MAP, CheckpointTuple, copy_checkpoint,
    get_serializable_checkpoint_metadata)
from langgraph.checkpoint.postgres import _ainternal
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.types import _DeltaSnapshot
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi.runtime.group_commit import GroupCommit

log = logging.getLogger(__name__)

MARK = "SELECT yuxi.mark_checkpoint_connection_v1(%s, %s)"


@contextlib.asynccontextmanager
async def checkpoint_connection(pool: AsyncConnectionPool) -> AsyncIterator[AsyncConnection]:
    """A connection of the checkpoint pool, unmarked when it goes back (a
    worker goes on with several runs of a session on one connection, marking
    it for each)."""
    async with pool.connection() as conn, unmarked_after(conn):
        yield conn


@contextlib.asynccontextmanager
async def unmarked_after(conn: AsyncConnection, *,
                         unless: Callable[[], bool] = lambda: False) -> AsyncIterator[None]:
    """Unmark `conn` (a checkpoint pool's, marked by a lease taken on it) at
    the end of the block, `unless` the block's last statement did (a
    completion with no run to go on with). A connection that cannot be
    unmarked is closed, never handed back marked: a write cancelled
    mid-query (a parallel tool call stopped by a cancel) leaves it broken,
    and that must not change the run's outcome."""
    try:
        yield
    finally:
        if not unless():
            await unmark(conn)


async def unmark(conn: AsyncConnection) -> None:
    try:
        if conn.broken or conn.closed:
            raise psycopg.InterfaceError("connection lost")
        await conn.execute(MARK, ("", ""))
    except asyncio.CancelledError:
        await conn.close()
        raise
    except Exception as exc:
        log.warning("closing a checkpoint connection that could not be unmarked: %s", exc)
        await conn.close()


# LangGraph's task path of the graph's model node (a pull task).
MODEL_TASK = "~__pregel_pull, model"

# A model call still running after this long gets the held writes of its
# turn's start sent meanwhile: the turn in flight shows its input in the
# conversation (`GET .../messages`) while a real model thinks; a fast answer
# takes them along (RunSaver.during_model_call).
HOLD_SECONDS = 0.05

T = TypeVar("T")


class Op(NamedTuple):
    """A statement of LangGraph's saver and what it writes: `kind`
    ("blobs", "checkpoint", "writes") and the checkpoint it belongs to."""

    query: str
    params: Any
    many: bool
    kind: str
    checkpoint_id: str


def latest_only(ops: list[Op]) -> list[Op]:
    """`ops` without what their last checkpoint supersedes: the earlier
    checkpoints, their pending writes and the blobs the last one does not
    reference. Only a thread's latest checkpoint is ever read (a run, a
    wait's resume and a cancel's cleanup all start there, and the turn's
    completion prunes the rest: prune_checkpoints_v1), so, written in one
    transaction with it, they would only be deleted again: a one-step turn
    writes one checkpoint and its blobs instead of three of each and their
    writes."""
    last = next((op for op in reversed(ops) if op.kind == "checkpoint"), None)
    if last is None:
        return ops
    versions = last.params[4].obj["channel_versions"]
    kept = []
    for op in ops:
        if op.kind == "blobs":
            rows = [r for r in op.params if versions.get(r[2]) == r[3]]
            if rows:
                kept.append(op._replace(params=rows))
        elif op.checkpoint_id == last.checkpoint_id:
            kept.append(op)
    return kept


def _read_key(config: Any, *, latest: bool = False) -> tuple[Any, ...]:
    """What a read of a checkpoint asks for: thread, namespace and
    checkpoint id (None, `latest`: the thread's latest)."""
    c = config["configurable"]
    return (c.get("thread_id"), c.get("checkpoint_ns", ""),
            None if latest else c.get("checkpoint_id"))


# LangGraph's read of a thread's latest checkpoint (aget_tuple without a
# checkpoint id), for the session of a run: read with the run's lease, in
# the lease's round trip (yuxi.services.runs.start_run_reading).
LATEST_OF_RUN = (AsyncPostgresSaver.SELECT_SQL
                 + "WHERE thread_id = (SELECT session_id::text FROM yuxi.runs WHERE id = %s) "
                   "AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1")


def _own_copy(found: CheckpointTuple | None) -> CheckpointTuple | None:
    """A read checkpoint for one reader: its maps copied (LangGraph's
    copy_checkpoint; the values themselves are never changed in place)."""
    return None if found is None else found._replace(checkpoint=copy_checkpoint(found.checkpoint))


class RunSaver(AsyncPostgresSaver):
    """The checkpointer of a run: LangGraph's Postgres saver, except that
    writes which nothing can run after are held back and go out with the
    checkpoint that follows them, in one pipeline (one implicit transaction,
    one round trip instead of two or three; issue 15):

    - a turn's input checkpoint (LangGraph's step -1, `source: input`), its
      writes and the step after it (the input applied), with the model's
      step; a model call still running after HOLD_SECONDS gets them written
      meanwhile (`during_model_call`: the turn in flight shows its input);
    - the writes of the model node, with the checkpoint of its step: the
      model node is the only task of its step (the graph's topology,
      yuxi.runtime.graph), so no other task runs in between, and its step's
      checkpoint is the next thing LangGraph writes;
    - when the model answered without tool calls, that checkpoint ends the
      graph: it and the model's writes wait for the run's completion, which
      the executor sends through `write_with` (complete_run_v1 in the same
      implicit transaction: the turn's last checkpoint commits with its
      result, one round trip for both);
    - when it answered with tool calls, that checkpoint and the model's
      writes wait for the step's `tool.started` events, which the executor's
      reporter sends through `write_with` before any tool runs (one round
      trip for the answer's event, its checkpoint and the calls' start; a
      tool's effect never comes before the step that asked for it is
      saved);
    - an interrupt (a wait tool, an approval, a question: each comes before
      its tool's effect), with the run's suspension (`write_with`): nothing
      runs after it but the suspension. A run cut off in between runs the
      interrupted call again, which asks again;
    - a resumed run's answer to its interrupt, with the interrupted call's
      `tool.started` (`write_with`): the call starts again before any
      effect. A run cut off in between is resumed with the same answer;
    - the writes of a step's tool calls that arrive once none of them runs
      any more (`last_call_ended`: the last one's, and those of the calls
      that ended with it), with the step's checkpoint, the next thing
      LangGraph writes. A run cut off in between calls them again, as if
      cut off during the calls.

    A held batch goes out without what its last checkpoint supersedes
    (`latest_only`): a one-step turn writes one checkpoint, not three.

    A worker that dies in between has written neither, as if it died a
    moment earlier: the next run of the turn starts from the checkpoint
    before (a turn whose input is not in the conversation starts again,
    `drive`; a model step not saved is made again). The writes of a tool
    call that ends while others of its step still run (each may have
    effects, and a later one may take long) and error writes go out at
    once, and anything else first sends what is held: the rest is
    LangGraph's own."""

    def __init__(self, conn: AsyncConnection, *, empty: bool = False,
                 latest: CheckpointTuple | None = None) -> None:
        super().__init__(conn)
        # `empty`: the thread has no checkpoint yet (the first run of a
        # session's first turn, yuxi.leased_run.first_run): reads of its
        # latest checkpoint need no round trip until this saver writes one.
        self._empty = empty
        # The last read and what it found, for later reads of the same
        # checkpoint until something is written: the run holds the lease, so
        # nothing else writes the thread meanwhile. (A turn's first run reads
        # the checkpoint to archive what an earlier turn left there, then
        # LangGraph reads it again to start; a resumed run's state is read,
        # then LangGraph reads it again to go on: one round trip for both.)
        # Each reader gets its own copy of the checkpoint's maps
        # (_own_copy): LangGraph applies pending writes to the checkpoint it
        # read (aget_state does), which the next reader must not see.
        # `latest`: the thread's latest checkpoint as the previous run on this
        # connection wrote it (`latest_tuple`; a hand-over within the
        # session, whose lease left no gap for another writer): LangGraph's
        # first read of this run is answered from it, without a round trip.
        self._reread: tuple[tuple[Any, ...], Any] | None = None
        if latest is not None:
            self._reread = (_read_key(latest.config, latest=True), latest)
        # What the last aput was given (config, checkpoint, metadata).
        self._put: tuple[Any, Any, Any] | None = None
        self._held: list[Op] = []
        self._held_id: str | None = None
        self._ending = False  # the held writes are a final answer's
        self._calling = False  # the held writes are an answer with tool calls
        self._starting = False  # the held writes are the turn's start
        self._task_writes = GroupCommit(self._flush_task_writes)
        # Statements that go out with the next pipeline, after its writes
        # (`along`: an answer's event with its step, a step's tool.finished
        # events with the tools' writes).
        self._along: list[Callable[[], tuple[str, Any] | None]] = []
        # No tool call of the step runs any more (`last_call_ended`): its
        # calls' writes wait for its checkpoint.
        self._step_ended = False

    def _checkpoint_ops(self, config, checkpoint, metadata, new_versions):
        # The statements of AsyncPostgresSaver.aput (langgraph-checkpoint-postgres 3.x).
        configurable = config["configurable"].copy()
        thread_id = configurable.pop("thread_id")
        checkpoint_ns = configurable.pop("checkpoint_ns")
        checkpoint_id = configurable.pop("checkpoint_id", None)
        copy = checkpoint.copy()
        copy["channel_values"] = copy["channel_values"].copy()
        blob_values = {}
        for k, v in checkpoint["channel_values"].items():
            if isinstance(v, _DeltaSnapshot):
                blob_values[k] = copy["channel_values"].pop(k)
                copy["channel_values"][k] = True
            elif v is None or isinstance(v, (str, int, float, bool)):
                pass
            else:
                blob_values[k] = copy["channel_values"].pop(k)
        ops: list[Op] = []
        if blob_versions := {k: v for k, v in new_versions.items() if k in blob_values}:
            ops.append(Op(self.UPSERT_CHECKPOINT_BLOBS_SQL,
                          self._dump_blobs(thread_id, checkpoint_ns, blob_values, blob_versions),
                          True, "blobs", checkpoint["id"]))
        ops.append(Op(self.UPSERT_CHECKPOINTS_SQL,
                      (thread_id, checkpoint_ns, checkpoint["id"], checkpoint_id, Jsonb(copy),
                       Jsonb(get_serializable_checkpoint_metadata(config, metadata))),
                      False, "checkpoint", checkpoint["id"]))
        return ops

    def _held_ids(self) -> set[str]:
        return {op.checkpoint_id for op in self._held if op.kind == "checkpoint"}

    def _take_held(self) -> list[Op]:
        held, self._held, self._held_id, self._ending = self._held, [], None, False
        self._calling = False
        self._starting = False
        return held

    async def _pipeline(self, ops: list[Op], query: str | None = None,
                        params: Any = None) -> Any:
        """`ops` (less what their last checkpoint supersedes), then `query`,
        in one pipeline (one implicit transaction: they commit together or
        not at all). Returns the query's first row."""
        async with self.lock, _ainternal.get_connection(self.conn) as conn:
            async with conn.pipeline():
                async with conn.cursor(binary=True) as cur:
                    for op in latest_only(ops):
                        if op.many:
                            await cur.executemany(op.query, op.params)
                        else:
                            await cur.execute(op.query, op.params)
                along, self._along = self._along, []
                for statement in along:
                    if (made := statement()) is not None:
                        await conn.execute(*made)
                if query is None:
                    return None
                cur = await conn.execute(query, params)
            return await cur.fetchone()

    async def _write(self, ops: list[Op]) -> None:
        """What is held, then `ops`, in one pipeline (one implicit transaction)."""
        if (ops := [*self._take_held(), *ops]) or self._along:
            await self._pipeline(ops)

    def along(self, statement: Callable[[], tuple[str, Any] | None]) -> None:
        """Send `statement()` (a query and its parameters, or None) with this
        saver's next write, after its checkpoint writes and before the
        write's own query, in the same transaction: an answer's `message`
        event goes with its step and its calls' `tool.started`, a tool's
        `tool.finished` with the tool's result (the write that follows it
        at once), one round trip each."""
        self._along.append(statement)

    async def during_model_call(self, call: Awaitable[T]) -> T:
        """`call` (a model call); if it is still running after HOLD_SECONDS,
        what is held of the turn's start is written meanwhile."""
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=HOLD_SECONDS)
            if not done and self._starting:
                await self._write([])
            return await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _writing(self) -> None:
        self._empty, self._reread = False, None

    async def write_held(self) -> None:
        """Write what is held now, and what goes along (the run ends before
        the write it was held for: its turn fails)."""
        await self._task_writes.settled()
        await self._write([])

    async def write_with(self, query: str, params: Any) -> Any:
        """What is held, then `query`, in one pipeline: they commit together
        (or not at all). Returns the query's first row."""
        await self._task_writes.settled()
        self._writing()
        return await self._pipeline(self._take_held(), query, params)

    def latest_tuple(self) -> CheckpointTuple | None:
        """The last checkpoint this saver was given, as LangGraph's read of
        it would return it (the thread's latest, once committed), or None
        (nothing put; a channel stored as a delta, which a read rebuilds)."""
        if self._put is None:
            return None
        config, checkpoint, metadata = self._put
        if any(isinstance(v, _DeltaSnapshot) for v in checkpoint["channel_values"].values()):
            return None
        c = config["configurable"]
        ids = {"thread_id": c["thread_id"], "checkpoint_ns": c.get("checkpoint_ns", "")}
        parent = c.get("checkpoint_id")
        return CheckpointTuple(
            config={"configurable": {**ids, "checkpoint_id": checkpoint["id"]}},
            checkpoint=copy_checkpoint(checkpoint),
            metadata=get_serializable_checkpoint_metadata(config, metadata),
            parent_config={"configurable": {**ids, "checkpoint_id": parent}} if parent else None,
            pending_writes=[])

    async def aput(self, config, checkpoint, metadata, new_versions):
        await self._task_writes.settled()  # a step's checkpoint after its tasks' writes
        self._writing()
        self._step_ended = False
        self._put = (config, checkpoint, metadata)
        if (metadata or {}).get("source") == "input" and not self._held:
            self._held = self._checkpoint_ops(config, checkpoint, metadata, new_versions)
            self._held_id, self._starting = checkpoint["id"], True
        elif self._starting and len(self._held_ids()) == 1 \
                and config["configurable"].get("checkpoint_id") == self._held_id:
            # The step after the input (the input applied) waits with it for
            # the model's step: one write for the turn's start and its first
            # answer.
            self._held += self._checkpoint_ops(config, checkpoint, metadata, new_versions)
            self._held_id = checkpoint["id"]
        elif self._ending and config["configurable"].get("checkpoint_id") == self._held_id:
            # The model answered without tool calls: this is the turn's last
            # checkpoint, held for the run's completion (write_with).
            self._held += self._checkpoint_ops(config, checkpoint, metadata, new_versions)
            self._held_id, self._ending = checkpoint["id"], False
        elif self._calling and config["configurable"].get("checkpoint_id") == self._held_id:
            # The model asked for tool calls: its step's checkpoint is held
            # for the calls' tool.started (write_with), which comes before
            # any of them runs; anything else written or read first takes it
            # along (_write, _flushed).
            self._held += self._checkpoint_ops(config, checkpoint, metadata, new_versions)
            self._held_id, self._calling = checkpoint["id"], False
        elif self._held:
            await self._write(self._checkpoint_ops(config, checkpoint, metadata, new_versions))
        else:
            return await super().aput(config, checkpoint, metadata, new_versions)
        return {"configurable": {"thread_id": config["configurable"]["thread_id"],
                                 "checkpoint_ns": config["configurable"]["checkpoint_ns"],
                                 "checkpoint_id": checkpoint["id"]}}

    async def aput_writes(self, config, writes, task_id, task_path=""):
        self._writing()
        checkpoint_id = config["configurable"]["checkpoint_id"]
        if (self._held and checkpoint_id == self._held_id) or (
                not self._held and task_path == MODEL_TASK
                and not any(w[0] in WRITES_IDX_MAP for w in writes)):
            # The model's answer without tool calls (its writes are its
            # messages only): the step's checkpoint ends the graph.
            self._ending = task_path == MODEL_TASK and all(w[0] == "messages" for w in writes)
            self._calling = task_path == MODEL_TASK and not self._ending
            self._held.append(self._writes_op(config, writes, task_id, task_path))
            self._held_id = checkpoint_id
            return
        op = self._writes_op(config, writes, task_id, task_path)
        if self._held_for_next(writes, task_path):
            # (`_held_id` stays: what is held here goes with whatever is
            # written next, not only with its own checkpoint.)
            self._held.append(op)
            return
        # A tool task's writes go out at once, together with those of the
        # step's other tasks finishing meanwhile (one pipeline for a
        # fan-out's results, not one transaction each), after what is held.
        await self._task_writes.submit(op)

    def _held_for_next(self, writes, task_path) -> bool:
        """Whether a task's writes wait for the run's next write, because
        nothing with an effect can run before it."""
        channels = {w[0] for w in writes}
        # A call that interrupted (before any effect): for the run's
        # suspension. A resumed run's answer: for the interrupted call's
        # tool.started. Writes arriving once no call of the step runs: for
        # the step's checkpoint, LangGraph's next write.
        return bool(writes) and (
            channels == {INTERRUPT} or channels == {RESUME}
            or (self._step_ended and task_path != MODEL_TASK
                and not channels & WRITES_IDX_MAP.keys()))

    def last_call_ended(self) -> None:
        """The run's reporter: a tool call ended and no other call of its
        step still runs. The step's writes that arrive from now on (this
        call's, and those of calls that ended with it) are held for the
        step's checkpoint."""
        self._step_ended = True

    def _writes_op(self, config, writes, task_id, task_path) -> Op:
        # The statement of AsyncPostgresSaver.aput_writes.
        query = (self.UPSERT_CHECKPOINT_WRITES_SQL
                 if all(w[0] in WRITES_IDX_MAP for w in writes)
                 else self.INSERT_CHECKPOINT_WRITES_SQL)
        checkpoint_id = config["configurable"]["checkpoint_id"]
        return Op(query, self._dump_writes(
            config["configurable"]["thread_id"], config["configurable"]["checkpoint_ns"],
            checkpoint_id, task_id, task_path, writes), True, "writes", checkpoint_id)

    async def _flushed(self) -> None:
        """Before a read: never read around what is held or in flight."""
        await self._task_writes.settled()
        await self._write([])

    async def _flush_task_writes(self, ops: list[Op]) -> list[None]:
        await self._write(ops)
        return [None] * len(ops)

    async def aget_tuple_with(self, config, query: str, params: Any) -> tuple[Any, list[Any]]:
        """The thread's latest checkpoint (as `aget_tuple` finds it; the
        config names no checkpoint) and `query`'s rows, in one round trip;
        the checkpoint is kept for LangGraph's next read of it. (A turn's
        first run reads the checkpoint an earlier turn left and the archive
        of the conversation together: one round trip where there were two.)"""
        if self._empty and not self._held:
            return None, []  # nothing ran in the thread: nothing to read either
        await self._flushed()
        key = _read_key(config, latest=True)
        async with self.lock, _ainternal.get_connection(self.conn) as conn:
            async with conn.pipeline(), conn.cursor(binary=True, row_factory=dict_row) as latest, \
                    conn.cursor(row_factory=dict_row) as other:
                # LangGraph's query of aget_tuple, for the latest checkpoint.
                await latest.execute(
                    self.SELECT_SQL + "WHERE thread_id = %s AND checkpoint_ns = %s "
                    "ORDER BY checkpoint_id DESC LIMIT 1", key[:2], binary=True)
                await other.execute(query, params)
                value = await latest.fetchone()
                rows = await other.fetchall()
        if value is not None and value["checkpoint"]["v"] < 4:
            return await self.aget_tuple(config), rows  # (pending sends to migrate)
        found = None if value is None else await self._load_checkpoint_tuple(value)
        self._reread = (key, found)
        return found, rows

    async def _load_checkpoint_tuple(self, value: Any) -> CheckpointTuple:
        """AsyncPostgresSaver's, except that a checkpoint without pending
        writes (what a run reads, nearly always) is built here: LangGraph
        loads the writes in a thread, a hop there and back (two wake-ups)
        for an empty list."""
        if value["pending_writes"]:
            return await super()._load_checkpoint_tuple(value)
        ids = {"thread_id": value["thread_id"], "checkpoint_ns": value["checkpoint_ns"]}
        parent = value["parent_checkpoint_id"]
        return CheckpointTuple(
            {"configurable": {**ids, "checkpoint_id": value["checkpoint_id"]}},
            {**value["checkpoint"],
             "channel_values": {**(value["checkpoint"].get("channel_values") or {}),
                                **self._load_blobs(value["channel_values"])}},
            value["metadata"],
            {"configurable": {**ids, "checkpoint_id": parent}} if parent else None,
            [])

    async def know_latest(self, thread_id: str, row: dict[str, Any] | None) -> bool:
        """The thread's latest checkpoint as a read of LATEST_OF_RUN found it
        (`row`, None: the thread has none) under this run's lease: LangGraph's
        first read of it is answered from it, without a round trip. False
        (nothing known) for a checkpoint LangGraph migrates as it reads."""
        if row is not None and row["checkpoint"]["v"] < 4:
            return False  # (pending sends to migrate: LangGraph's own read)
        found = None if row is None else await self._load_checkpoint_tuple(row)
        self._reread = (_read_key({"configurable": {"thread_id": thread_id}}, latest=True), found)
        return True

    def known_latest(self, config) -> tuple[bool, CheckpointTuple | None]:
        """(True, the thread's latest checkpoint) when this saver knows it
        without a read (know_latest, or a carried one), without using it up
        for LangGraph's read; (False, None) otherwise."""
        if self._known(_read_key(config, latest=True)):
            return True, self._reread[1]
        return False, None

    def _known(self, key: tuple[Any, ...]) -> bool:
        """Whether the last read (or what was known without one) answers a
        read of `key` now: nothing written since."""
        return self._reread is not None and self._reread[0] == key and not self._held

    async def aget_tuple(self, config):
        if self._empty and not self._held:
            return None
        if self._known(key := _read_key(config)):
            return _own_copy(self._reread[1])
        await self._flushed()
        found = await super().aget_tuple(config)
        self._reread = (key, found)
        return _own_copy(found)
