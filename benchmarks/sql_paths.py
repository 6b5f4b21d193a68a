"""Backend CPU of the hot SQL paths, one connection, one call at a time (a
diagnostic, not a test).

    python -m benchmarks.sql_paths [--sessions K] [--database-url URL]

Per session, twice over K fresh sessions (the first pass warms the plans and
is not counted): receive an input into the idle session (its turn starts),
receive a second one (queued), take the first run's lease (`start_run_v1`),
complete it handing the second turn over to the same caller
(`complete_run_v1` with a next token), complete that one too. Each call is
metered by the CPU its backend spent (/proc/<pid>/schedstat), and the
database tracks every function (`track_functions = 'all'`): the report ends
with calls, total and self time per function and per session, so a change
to sql/ can be compared run against run (alternate the two versions: this
machine's speed drifts).

It DROPS and recreates its database: default `yuxi_sql_paths` on the server
of $YUXI_BENCH_DATABASE_URL (or 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import uuid

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from benchmarks.run import DEFAULT_URL

RECEIVE = ("SELECT * FROM yuxi.receive_input_receipt_v1(%s, %s, %s, %s, 'queue', NULL, %s, "
           "false)")
START = "SELECT * FROM yuxi.start_run_v1(%s, %s, 30, true) WHERE id IS NOT NULL"
SUSPEND = ("SELECT s.outcome, (s.next_run).id FROM yuxi.suspend_run_v1(%s, %s, 'inputs', %s, "
           "'{}', 600, %s, 30, true) s")
COMPLETE = ("SELECT c.outcome, (c.next_run).id FROM yuxi.complete_run_v1(%s, %s, %s, '{}', %s, "
            "30, %s, true) c")


def backend_cpu_us(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1000


async def flush_stats(conn: psycopg.AsyncConnection) -> None:
    """This backend's pending statistics to the shared views (at the end of
    the next transaction)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")


async def main_async(url: str, k: int, paths: tuple[str, ...]) -> None:
    from yuxi import db, schema

    name = db.database_name(url)
    async with await psycopg.AsyncConnection.connect(db.with_database(url, "postgres"),
                                                     autocommit=True) as admin:
        await admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                            .format(sql.Identifier(name)))
        await admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        await admin.execute(sql.SQL("ALTER DATABASE {} SET track_functions = 'all'")
                            .format(sql.Identifier(name)))
    await schema.apply_schema(url)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True,
                                                     prepare_threshold=0) as conn:
        async def one(query: str, params: tuple = ()) -> tuple:
            return await (await conn.execute(query, params)).fetchone()

        (pid,) = await one("SELECT pg_backend_pid()")
        (user,) = await one("INSERT INTO yuxi.users (name) VALUES ('sql-paths') RETURNING id")
        (app,) = await one("INSERT INTO yuxi.apps (name) VALUES ('sql-paths') RETURNING id")
        (agent,) = await one("INSERT INTO yuxi.agents (user_id, app_id, name, config) "
                             "VALUES (%s, %s, 'a', '{\"model\": \"replay\"}') RETURNING id",
                             (user, app))
        spent: dict[str, float] = collections.defaultdict(float)

        async def metered(label: str, query: str, params: tuple) -> tuple:
            before = backend_cpu_us(pid)
            row = await one(query, params)
            spent[label] += backend_cpu_us(pid) - before
            return row

        events = Jsonb([{"type": "message", "data": {"text": "ok"}}])
        if "sessions" in paths:
            for counted in (False, True):
                sessions = [(await one("SELECT id FROM yuxi.create_root_session_v1("
                                       "%s, %s, %s, 't', '{\"model\": \"replay\"}')",
                                       (user, app, agent)))[0] for _ in range(k)]
                if counted:
                    await reset(conn, spent)
                for session in sessions:
                    first = await metered("receive (the turn starts)", RECEIVE,
                                          (session, user, app, "one", str(uuid.uuid4())))
                    await metered("receive (queued)", RECEIVE,
                                  (session, user, app, "two", str(uuid.uuid4())))
                    (run,) = await one("SELECT id FROM yuxi.runs WHERE turn_id = %s",
                                       (first[3],))
                    token, next_token = uuid.uuid4(), uuid.uuid4()
                    await metered("start_run", START, (run, token))
                    outcome, following = await metered(
                        "complete_run (hand-over)", COMPLETE,
                        (run, token, Jsonb({"text": "ok"}), next_token, events))
                    if outcome != "completed" or following is None:
                        raise RuntimeError(f"no hand-over: {outcome}, {following}")
                    outcome, _ = await metered(
                        "complete_run (the last)", COMPLETE,
                        (following, next_token, Jsonb({"text": "ok"}), None, events))
                    if outcome != "completed":
                        raise RuntimeError(f"completion: {outcome}")
            await report(conn, url, spent, k, "per session (the five calls above)")
        if "fanout" in paths:
            # A fan-out's children, one chain: a root holding its tree's only
            # slot creates them (pending), waits for their inputs and hands
            # the slot over as it suspends; each child's completion hands it
            # to the next (the last one's, to the root's resume run).
            for counted in (False, True):
                (root,) = await one("SELECT id FROM yuxi.create_root_session_v1("
                                    "%s, %s, %s, 't', '{\"model\": \"replay\"}')",
                                    (user, app, agent))
                await conn.execute("UPDATE yuxi.trees SET slot_capacity = 1 WHERE id = %s",
                                   (root,))
                first = await one(RECEIVE, (root, user, app, "fan out", str(uuid.uuid4())))
                (run,) = await one("SELECT id FROM yuxi.runs WHERE turn_id = %s", (first[3],))
                token, next_token = uuid.uuid4(), uuid.uuid4()
                await one(START, (run, token))
                inputs = [r[0] for r in await (await conn.execute(
                    "SELECT input_id FROM yuxi.create_children_v1(%s, %s, NULL, "
                    "'{\"model\": \"replay\"}', %s) ORDER BY ord",
                    (root, run, Jsonb([{"name": f"c{i}", "task": f"task {i}"}
                                       for i in range(k)])))).fetchall()]
                outcome, child = await one(SUSPEND, (run, token, inputs, next_token))
                if counted:
                    await reset(conn, spent)
                for _ in range(k):
                    token, next_token = next_token, uuid.uuid4()
                    outcome, following = await metered(
                        "complete_run (fan-out child)", COMPLETE,
                        (child, token, Jsonb({"text": "ok"}), next_token, events))
                    if outcome != "completed" or following is None:
                        raise RuntimeError(f"no hand-over: {outcome}, {following}")
                    child = following
            await report(conn, url, spent, k, "per fan-out child (its completion)")


async def reset(conn: psycopg.AsyncConnection, spent: dict[str, float]) -> None:
    """Count from here: backend CPU and the function statistics."""
    spent.clear()
    await flush_stats(conn)
    await conn.execute("SELECT pg_stat_reset()")


async def report(conn: psycopg.AsyncConnection, url: str, spent: dict[str, float], k: int,
                 per: str) -> None:
    print(f"{k} times; backend CPU per call:")
    for label, us in spent.items():
        print(f"  {label:28} {us / k:7.0f} µs")
    await flush_stats(conn)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as other:
        rows = await (await other.execute(
            "SELECT schemaname || '.' || funcname, calls, total_time, self_time "
            "FROM pg_stat_user_functions WHERE calls > 0 ORDER BY self_time DESC")).fetchall()
    print(f"{per}, wall time inside each function:")
    for fname, calls, total, self_ms in rows:
        print(f"  {fname:44} {calls / k:5.2f} calls  total {total / k * 1000:6.0f} µs  "
              f"self {self_ms / k * 1000:6.0f} µs")


def main() -> None:
    from yuxi import db

    default = db.with_database(os.environ.get("YUXI_BENCH_DATABASE_URL", DEFAULT_URL),
                               "yuxi_sql_paths")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--database-url", default=default)
    parser.add_argument("--paths", default="sessions,fanout",
                        help="which paths: sessions (a session's two turns), fanout (a "
                             "fan-out's children, one chain), or both (default)")
    args = parser.parse_args()
    asyncio.run(main_async(args.database_url, args.sessions,
                           tuple(args.paths.split(","))))


if __name__ == "__main__":
    main()
