"""Where one run's CPU goes, operation by operation (a diagnostic, not a test).

    python -m benchmarks.ops [--runs M] [--database-url URL]

Executes M runs one at a time with the worker's RunExecutor in this process,
on pools of ONE connection each, and wraps the operations of a run (service
calls, checkpoint reads and writes, graph build, drive) with meters:

- py cpu: this process's CPU time (time.process_time) inside the operation;
- pg cpu: CPU time of the two PostgreSQL backends serving the pools
  (/proc/<pid>/schedstat, nanoseconds) inside the operation;
- wall: elapsed time.

Nothing else runs meanwhile, so the meters attribute cleanly; nested
operations are included in their callers (execute > drive > ainvoke > aput).
Then the same with the triggers of LangGraph's tables (the lease fence)
disabled, and the bare graph (what `benchmarks.run` calls "direct"), so the
costs of the fence and of the executor are differences of two rows.

It DROPS and recreates its database: default `yuxi_bench_ops` on the server
of $YUXI_BENCH_DATABASE_URL (or 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import os
import sys
import time
import uuid
from typing import Any

from psycopg.conninfo import make_conninfo

from benchmarks import run as bench

Meter = list  # [calls, py cpu s, wall s, pg cpu s]
STATS: dict[str, Meter] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
BACKENDS: list[int] = []


def backend_cpu() -> float:
    total = 0
    for pid in BACKENDS:
        with open(f"/proc/{pid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _record(label: str, c0: float, t0: float, b0: float) -> None:
    s = STATS[label]
    s[0] += 1
    s[1] += time.process_time() - c0
    s[2] += time.perf_counter() - t0
    s[3] += backend_cpu() - b0


def meter(owner: Any, name: str, label: str) -> None:
    """Replace owner.name by a metered wrapper (skipped when it is missing)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0, t0, b0 = time.process_time(), time.perf_counter(), backend_cpu()
            try:
                return await fn(*args, **kwargs)
            finally:
                _record(label, c0, t0, b0)
    else:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0, t0, b0 = time.process_time(), time.perf_counter(), backend_cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                _record(label, c0, t0, b0)
    setattr(owner, name, wrapper)


def table(title: str, runs: int) -> str:
    lines = [f"--- {title} ---",
             f"  {'operation':34} {'calls':>6} {'py cpu ms':>10} {'pg cpu ms':>10} "
             f"{'wall ms':>9}   (per run)"]
    for label, (n, cpu, wall, pg) in sorted(STATS.items(), key=lambda kv: -kv[1][1] - kv[1][3]):
        if n:
            lines.append(f"  {label:34} {n / runs:6.1f} {cpu / runs * 1000:10.2f} "
                         f"{pg / runs * 1000:10.2f} {wall / runs * 1000:9.2f}")
    STATS.clear()
    return "\n".join(lines)


async def main_async(runs: int, url: str) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from langgraph.pregel import Pregel

    from yuxi import db
    from yuxi.runtime import executor as ex
    from yuxi.services import runs as run_services
    from yuxi.services import sessions as session_services
    from yuxi.services.sessions import CONFIG_DEFAULTS
    from yuxi.settings import Settings

    await bench.fresh_database(url)
    _key, scope, agent_id = await bench.create_key_and_agent(url)
    pool = db.app_pool(url, min_size=1, max_size=1)
    checkpoints = db.checkpoint_pool(url, min_size=1, max_size=1)
    await pool.open(wait=True)
    await checkpoints.open(wait=True)
    for p in (pool, checkpoints):
        async with p.connection() as conn:
            row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
            BACKENDS.append(row["pid"])

    async def prepare(n: int) -> list[uuid.UUID]:
        """n fresh sessions, each with one input whose run is ready."""
        ids = []
        for i in range(n):
            session = await session_services.create_session(
                pool, scope, agent_id=agent_id, default_model="replay")
            receipt = await session_services.receive_input(
                pool, scope, session.id, content=f"turn {i}", mode="queue")
            async with pool.connection() as conn:
                cur = await conn.execute("SELECT id FROM yuxi.runs WHERE turn_id = %s "
                                     "ORDER BY created_at DESC LIMIT 1", (receipt.turn_id,))
                ids.append((await cur.fetchone())["id"])
        return ids

    executor = ex.RunExecutor(Settings.from_env({"YUXI_DATABASE_URL": url}), pool, checkpoints)
    for run_id in await prepare(20):  # warm-up: caches, plans, imports
        await executor.execute(run_id)

    # Every service call of the worker side, whatever they are today.
    for name, fn in list(vars(run_services).items()):
        if not name.startswith("_") and asyncio.iscoroutinefunction(fn):
            meter(run_services, name, f"runs.{name}")
    with contextlib.suppress(ImportError):
        from yuxi.services import resources
        meter(resources, "resolve", "resources.resolve")
    meter(session_services, "receive_input", "sessions.receive_input (API)")
    meter(ex, "drive", "executor.drive")
    meter(ex, "build_graph", "build_graph")
    meter(ex, "build_chat_model", "build_chat_model")
    meter(Pregel, "aget_state", "graph.aget_state")
    meter(Pregel, "ainvoke", "graph.ainvoke")
    meter(AsyncPostgresSaver, "aput", "saver.aput (checkpoint)")
    meter(AsyncPostgresSaver, "aput_writes", "saver.aput_writes")
    meter(AsyncPostgresSaver, "aget_tuple", "saver.aget_tuple")
    meter(ex.RunExecutor, "execute", "RunExecutor.execute")

    async def fence_triggers(enable: bool) -> None:
        """What-if: the user triggers of LangGraph's tables (the lease fence of
        checkpoint writes) on or off, in this scratch database only."""
        async with pool.connection() as conn:
            for t in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
                await conn.execute(f"ALTER TABLE {db.CHECKPOINT_SCHEMA}.{t} "
                                   f"{'ENABLE' if enable else 'DISABLE'} TRIGGER USER")

    out = []
    for title, fenced in (("RunExecutor as is", True),
                          ("what-if: checkpoint tables without their (fence) triggers", False)):
        await fence_triggers(fenced)
        STATS.clear()
        ids = await prepare(runs)
        if fenced:
            out.append(table("API side: receive_input service (one transaction)", runs))
        STATS.clear()
        outcomes: collections.Counter[str] = collections.Counter()
        for run_id in ids:
            outcomes[await executor.execute(run_id)] += 1
        if set(outcomes) != {"completed"}:
            out.append(f"  (outcomes: {dict(outcomes)})")
        out.append(table(title, runs))
    await fence_triggers(True)

    config = {**CONFIG_DEFAULTS, **bench.AGENT_CONFIG}
    for i in range(runs):
        c0, t0, b0 = time.process_time(), time.perf_counter(), backend_cpu()
        thread = str(uuid.uuid4())
        model = ex.build_chat_model("replay", config, approval_mode="auto",
                                    session={"id": thread, "name": "root", "path": "/root",
                                             "parent_id": None, "tree_id": thread})
        graph = ex.build_graph(model, {}, bench.NoopReporter(),
                               preamble=[SystemMessage(content="identity", id="identity:x")],
                               checkpointer=AsyncPostgresSaver(checkpoints))
        await graph.ainvoke({"messages": [HumanMessage(content=f"turn {i}",
                                                       id=f"input:{uuid.uuid4()}")]},
                            {"configurable": {"thread_id": thread}}, durability="sync")
        _record("direct: build + ainvoke", c0, t0, b0)
    out.append(table("direct: the bare graph, plain saver (as benchmarks.run)", runs))
    await pool.close()
    await checkpoints.close()
    print(f"{runs} runs, one at a time, pools of one connection; database {url}")
    print("\n".join(out))


def main() -> None:
    server = os.environ.get("YUXI_BENCH_DATABASE_URL", bench.DEFAULT_URL)
    p = argparse.ArgumentParser(prog="python -m benchmarks.ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--database-url", default=make_conninfo(server, dbname="yuxi_bench_ops"))
    a = p.parse_args()
    async def locked() -> None:
        async with bench.exclusive(a.database_url):
            await main_async(a.runs, a.database_url)

    asyncio.run(locked())
    sys.exit(0)


if __name__ == "__main__":
    main()
