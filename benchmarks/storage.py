"""Storage per turn of one long session (issue 15, item 6).

    python -m benchmarks.storage [--turns 1000] [--message-bytes 700]
                                 [--database-url URL]

One fresh database (`yuxi_storage`, dropped and recreated), one session of
a one-step replay agent that answers `ok <input>`, and `--turns` turns run
one after another through the real services and the worker's RunExecutor
in this process (receive_input, then execute the ready run: checkpoints,
the fence, complete_run_v1 with its checkpoint pruning), each input
`--message-bytes` long (so the answer is as long: two such messages a
turn).

At turns 20, 100, 500 and 1,000 (scaled with --turns) the script reads, per
table group, (a) the live bytes: the sum of pg_column_size of the rows
(values as stored: compressed, TOAST included, no index, no dead rows) and
(b) the bytes on disk: pg_total_relation_size (heap, TOAST, indexes) right
after a VACUUM of the tables (as autovacuum would leave them; pruned rows'
space is then reused, never returned), and (c) the row bytes written: every
row inserted or updated, as stored (pg_column_size, summed by a row trigger
the bench installs), which counts what pruning deletes again. Bytes per turn
of a window = the growth over it / its turns.

Target: bytes per turn (live and written) over turns 500-1,000 at most 1.3x
those of turns 20-100, and at most 12 KB per turn with 0.7 KB messages.

A report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from typing import Any

import psycopg

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_storage"
GROUPS = {
    "langgraph": ["langgraph.checkpoints", "langgraph.checkpoint_blobs",
                  "langgraph.checkpoint_writes"],
    "yuxi": ["yuxi.events", "yuxi.runs", "yuxi.turns", "yuxi.inputs", "yuxi.conversation"],
}
TABLES = [t for ts in GROUPS.values() for t in ts]

# Bytes written: every row inserted or updated in the measured tables, as
# stored (pg_column_size of the row: compressed, TOASTed values counted at
# their stored size, no index, no WAL overhead), summed by a row trigger the
# bench installs in its own database (bench_written, in `public`). Unlike the
# live bytes, it counts what pruning deletes again and every row version.
WRITTEN = """
CREATE TABLE public.bench_written (tbl text NOT NULL, bytes integer NOT NULL);
CREATE FUNCTION public.bench_count_written() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.bench_written VALUES (TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME,
                                             pg_column_size(NEW.*));
    RETURN NULL;
END $$;
"""
TOAST_CHUNK = 1996  # TOAST_MAX_CHUNK_SIZE with 8 kB pages: the bytes of a full chunk


def words(rng: random.Random, size: int) -> str:
    """`size` characters of random lowercase words: text that compresses
    about as little as prose does (repeated text would compress to nothing
    in TOAST and hide the growth)."""
    out: list[str] = []
    length = 0
    while length < size:
        word = "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz"[:rng.randint(8, 26)])
                       for _ in range(rng.randint(2, 9)))
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:size]


def present(conn: psycopg.Connection) -> list[str]:
    """The measured tables this schema has (yuxi.conversation is new)."""
    return [t for t in TABLES
            if conn.execute("SELECT to_regclass(%s)", (t,)).fetchone()[0] is not None]


def install_written(conn: psycopg.Connection) -> None:
    conn.execute(WRITTEN)
    for table in present(conn):
        conn.execute(f"CREATE TRIGGER bench_written AFTER INSERT OR UPDATE ON {table} "
                     "FOR EACH ROW EXECUTE FUNCTION public.bench_count_written()")


def measure(conn: psycopg.Connection) -> dict[str, tuple[int, int, int, int]]:
    """Per table: (live row bytes, bytes on disk after VACUUM, TOAST chunks
    inserted so far, row bytes written so far). The writers' pools are
    closed before (an exiting backend flushes its statistics)."""
    tables = present(conn)
    conn.execute("VACUUM " + ", ".join(tables))
    written = dict(conn.execute("SELECT tbl, sum(bytes) FROM public.bench_written GROUP BY tbl"
                                ).fetchall())
    out = {t: (0, 0, 0, 0) for t in TABLES}
    for table in tables:
        live = conn.execute(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t"
                            ).fetchone()[0]
        disk = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (table,)).fetchone()[0]
        chunks = conn.execute(
            "SELECT coalesce(s.n_tup_ins, 0) FROM pg_class c "
            "LEFT JOIN pg_stat_all_tables s ON s.relid = c.reltoastrelid "
            "WHERE c.oid = %s::regclass", (table,)).fetchone()[0]
        out[table] = (int(live), int(disk), int(chunks), int(written.get(table) or 0))
    return out


async def run(opts: argparse.Namespace) -> dict[int, dict[str, tuple[int, int, int, int]]]:
    from benchmarks.run import fresh_database
    from yuxi import db
    from yuxi.runtime.executor import RunExecutor
    from yuxi.services import accounts, sessions
    from yuxi.settings import Settings

    await fresh_database(opts.database_url)

    async def open_pools() -> tuple[Any, Any, Any]:
        pool = db.app_pool(opts.database_url, max_size=4)
        checkpoints = db.checkpoint_pool(opts.database_url, max_size=4)
        await pool.open(wait=True)
        await checkpoints.open(wait=True)
        executor = RunExecutor(Settings(database_url=opts.database_url), pool, checkpoints,
                               max_continued_runs=0)
        return pool, checkpoints, executor

    pool, checkpoints, executor = await open_pools()
    points = sorted({p for p in (20, 100, opts.turns // 2, opts.turns) if p <= opts.turns})
    readings: dict[int, dict[str, tuple[int, int, int, int]]] = {}
    try:
        _key, scope = await accounts.create_key(pool, "storage", "storage")
        agent = await accounts.create_agent(
            pool, scope, "storage-replay",
            {"model": "replay", "replay": {"default": [{"say": "ok {{ input }}"}]}})
        session = await sessions.create_session(pool, scope, agent_id=agent.id,
                                                default_model="replay")
        sync = psycopg.connect(opts.database_url, autocommit=True)
        install_written(sync)
        readings[0] = measure(sync)
        rng = random.Random(6)
        began = time.perf_counter()
        for n in range(1, opts.turns + 1):
            text = f"turn {n} " + words(rng, opts.message_bytes)
            receipt = await sessions.receive_input(pool, scope, session.id,
                                                   content=text[:opts.message_bytes],
                                                   mode="queue")
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT id FROM yuxi.runs WHERE turn_id = %s AND status = 'ready'",
                    (receipt.turn_id,))
                run_id = (await cur.fetchone())["id"]
            outcome = await executor.execute(run_id)
            if outcome != "completed":
                raise RuntimeError(f"turn {n}: {outcome}")
            if n in points:
                await pool.close()
                await checkpoints.close()
                readings[n] = measure(sync)
                pool, checkpoints, executor = await open_pools()
                print(f"storage: turn {n} ({time.perf_counter() - began:.0f} s)",
                      file=sys.stderr)
        sync.close()
    finally:
        await pool.close()
        await checkpoints.close()
    return readings


def per_turn(readings: dict[int, dict[str, tuple[int, int, int, int]]], a: int, b: int,
             tables: list[str], k: int) -> float:
    return sum(readings[b][t][k] - readings[a][t][k] for t in tables) / (b - a)


def report(opts: argparse.Namespace, readings: dict[int, dict[str, tuple[int, int, int, int]]],
           elapsed: float) -> str:
    n = opts.turns
    early, late = (20, 100), (n // 2, n)
    lines = [
        f"Storage of one {n}-turn session, {opts.message_bytes}-byte messages "
        f"(input and answer), {os.cpu_count()} vCPUs, {elapsed:.0f} s",
        "",
        f"| bytes per turn | turns {early[0]}–{early[1]} | turns {late[0]}–{late[1]} | ratio |",
        "|---|---|---|---|",
    ]
    for k, kind in ((0, "live rows"), (1, "on disk (after VACUUM)")):
        for group, tables in [*GROUPS.items(), ("total", TABLES)]:
            x = per_turn(readings, *early, tables, k)
            y = per_turn(readings, *late, tables, k)
            lines.append(f"| {kind}: {group} | {x:,.0f} | {y:,.0f} | "
                         f"{y / x if x else float('nan'):.2f} |")
    for group, tables in [*GROUPS.items(), ("total", TABLES)]:
        x = per_turn(readings, *early, tables, 3)
        y = per_turn(readings, *late, tables, 3)
        lines.append(f"| row bytes written: {group} | {x:,.0f} | {y:,.0f} | "
                     f"{y / x if x else float('nan'):.2f} |")
    for group, tables in [*GROUPS.items(), ("total", TABLES)]:
        x = per_turn(readings, *early, tables, 2) * TOAST_CHUNK
        y = per_turn(readings, *late, tables, 2) * TOAST_CHUNK
        lines.append(f"| written to TOAST (chunks x {TOAST_CHUNK:,}): {group} | {x:,.0f} | "
                     f"{y:,.0f} | {y / x if x else float('nan'):.2f} |")
    lines += ["", "Per table at the end (live rows / on disk, bytes):", ""]
    for t in TABLES:
        live, disk, _chunks, _written = readings[n][t]
        lines.append(f"- {t}: {live:,} / {disk:,}")
    live_total = per_turn(readings, *late, TABLES, 0)
    disk_total = per_turn(readings, *late, TABLES, 1)
    ratio = live_total / per_turn(readings, *early, TABLES, 0)
    written_total = per_turn(readings, *late, TABLES, 3)
    written_ratio = written_total / per_turn(readings, *early, TABLES, 3)
    lines += [
        "",
        f"storage: live bytes/turn {late[0]}-{late[1]} = {live_total:,.0f} "
        f"(ratio to {early[0]}-{early[1]}: {ratio:.2f}; targets <= 1.3 and <= 12,288: "
        f"{'met' if ratio <= 1.3 and live_total <= 12288 else 'NOT met'}); "
        f"on disk {disk_total:,.0f}",
        f"storage: row bytes written/turn {late[0]}-{late[1]} = {written_total:,.0f} "
        f"(ratio to {early[0]}-{early[1]}: {written_ratio:.2f}; targets <= 1.3 and <= 12,288: "
        f"{'met' if written_ratio <= 1.3 and written_total <= 12288 else 'NOT met'})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.storage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=1000)
    p.add_argument("--message-bytes", type=int, default=700)
    p.add_argument("--database-url",
                   default=os.environ.get("YUXI_STORAGE_DATABASE_URL", DEFAULT_URL),
                   help=f"database to DROP and recreate (default {DEFAULT_URL})")
    opts = p.parse_args(argv)
    if opts.turns < 200:
        p.error("--turns must be at least 200 (windows 20-100 and n/2-n)")
    began = time.perf_counter()
    readings = asyncio.run(run(opts))
    print(report(opts, readings, time.perf_counter() - began))
    return 0


if __name__ == "__main__":
    sys.exit(main())
