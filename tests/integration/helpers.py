"""Shared steps of integration tests: build sessions and drive runs in-process
with the real executor (no worker process; the jobs it would pick are in
procrastinate_jobs all the same)."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from yuxi import db
from yuxi.domain import Scope
from yuxi.runtime.executor import RunExecutor
from yuxi.services import accounts, sessions
from yuxi.settings import Settings


def say_agent(text: str = "echo: {{ input }}", **step: Any) -> dict[str, Any]:
    return {"model": "replay", "replay": {"default": [{"say": text, **step}]}}


async def new_session(pool, scope: Scope, config: dict[str, Any] | None = None,
                      name: str | None = None):
    agent = await accounts.create_agent(
        pool, scope, name or f"agent-{uuid.uuid4().hex[:8]}", config or say_agent())
    return await sessions.create_session(pool, scope, agent_id=agent.id, default_model="replay")


def executor(pool, checkpoint_pool, continued_runs: int | None = None,
             **settings: Any) -> RunExecutor:
    """The worker's executor; `continued_runs=0` executes exactly the run given."""
    extra = {} if continued_runs is None else {"max_continued_runs": continued_runs}
    return RunExecutor(Settings(**settings), pool, checkpoint_pool, **extra)


def checkpoint_reads(monkeypatch) -> list[str]:
    """The thread ids of the checkpoint reads that reach the database
    (LangGraph's, and the run saver's read with the archive)."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from yuxi.runtime.saver import RunSaver

    made: list[str] = []
    original = AsyncPostgresSaver.aget_tuple

    async def counted(self, config):
        made.append(config["configurable"]["thread_id"])
        return await original(self, config)

    monkeypatch.setattr(AsyncPostgresSaver, "aget_tuple", counted)
    original_with = RunSaver.aget_tuple_with

    async def counted_with(self, config, query, params):
        if not self._empty:  # (an empty thread's is answered without a read)
            made.append(config["configurable"]["thread_id"])
        return await original_with(self, config, query, params)

    monkeypatch.setattr(RunSaver, "aget_tuple_with", counted_with)
    return made


async def runs_with_status(pool, status: str, tree_id=None) -> list[uuid.UUID]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id FROM yuxi.runs WHERE status = %s AND (%s::uuid IS NULL OR tree_id = %s::uuid)"
            " ORDER BY slot_seq", (status, tree_id, tree_id))
        return [r["id"] for r in await cur.fetchall()]


async def drain(pool, checkpoint_pool, **settings: Any) -> list[str]:
    """Execute ready runs until none is left, like a worker would."""
    ex = executor(pool, checkpoint_pool, **settings)
    outcomes = []
    while ready := await runs_with_status(pool, "ready"):
        for run_id in ready:
            outcomes.append(await ex.execute(run_id))
    return outcomes


async def scalar(pool, sql: str, params: Any = None) -> Any:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
        return next(iter(row.values())) if row else None


async def rows(pool, sql: str, params: Any = None) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        return await cur.fetchall()


async def events(pool, tree_id) -> list[dict[str, Any]]:
    async with pool.connection() as conn:
        return await db.fetch_all(conn, "events_after", {
            "tree_id": tree_id, "after": 0, "session_id": None, "limit": 10_000})


# Negative cases redefine a transition without its guard: the text replaced
# must be in the function, or the test would prove nothing.
FUNCTION_SOURCE = "SELECT pg_get_functiondef(%s::regproc)"


def _rewritten(source: str, old: str, new: str) -> str:
    assert old in source, f"{old!r} is not in the function any more"
    return source.replace(old, new, 1)


async def rewrite_function(pool, name: str, old: str, new: str) -> str:
    """Redefine SQL function `name` with `old` replaced by `new`; returns the
    original source (execute it to restore the function)."""
    async with pool.connection() as conn:
        row = await (await conn.execute(FUNCTION_SOURCE, (name,))).fetchone()
        source = next(iter(row.values()))
        await conn.execute(_rewritten(source, old, new))
    return source


def rewrite_function_sync(conn, name: str, old: str, new: str) -> str:
    """rewrite_function on a synchronous connection (the caller commits)."""
    source = conn.execute(FUNCTION_SOURCE, (name,)).fetchone()[0]
    conn.execute(_rewritten(source, old, new))
    return source


@contextlib.asynccontextmanager
async def fenced_saver(pool, run_id: uuid.UUID, token: uuid.UUID):
    """A checkpointer on a checkpoint connection marked with a run's lease, as
    the worker's is (start_run_v1 / complete_run_v1 mark it in production):
    the fence tests write through it directly."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from yuxi.runtime.saver import MARK, checkpoint_connection

    async with checkpoint_connection(pool) as conn:
        await conn.execute(MARK, (str(run_id), str(token)))
        yield AsyncPostgresSaver(conn)


def spy_model_calls(monkeypatch, attr: str = "text", *, preamble: bool = False) -> list[list[str]]:
    """What each model call is given from now on: each message's `attr`
    (text or id), without the preamble (identity, system prompt) unless
    `preamble`."""
    from yuxi.runtime import graph as graph_module

    seen: list[list[str]] = []
    real = graph_module.call_chat_model

    def spy(bound, messages, *args):
        seen.append([getattr(m, attr) for m in messages
                     if preamble or not m.id.startswith(("identity:", "system"))])
        return real(bound, messages, *args)

    monkeypatch.setattr(graph_module, "call_chat_model", spy)
    return seen
