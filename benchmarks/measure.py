"""Where the time goes: CPU seconds of processes (from /proc) and PostgreSQL
activity counters (pg_stat_database, pg_stat_user_tables) around a phase.

PostgreSQL (15+) flushes a backend's counters when it goes idle, at most once
a second, and an idle backend with pending counters flushes after 10 s; a
backend that exits flushes at once. Snapshots are therefore taken after the
counted backends exited or after `STATS_SETTLE_SECONDS` of quiet.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

STATS_SETTLE_SECONDS = 11.0
_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces: split after its closing parenthesis.
    return raw[raw.rindex(")") + 2:].split()


def process_cpu(pid: int, *, children: bool = False) -> float:
    """utime + stime of a process in seconds (0 when it is gone)."""
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    ticks = int(f[11]) + int(f[12])
    if children:
        ticks += int(f[13]) + int(f[14])
    return ticks / _TICK


def postgres_cpu() -> float:
    """CPU seconds of the whole PostgreSQL server: every live `postgres`
    process, plus the reaped children accounted to the postmaster. Includes
    other databases' work on the same server."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm != "postgres":
            continue
        f = _stat_fields(entry.name)
        if f is None:
            continue
        total += int(f[11]) + int(f[12])
        ppid = int(f[1])
        try:
            parent = Path(f"/proc/{ppid}/comm").read_text().strip()
        except OSError:
            parent = ""
        if parent != "postgres":  # the postmaster: add its reaped backends
            total += int(f[13]) + int(f[14])
    return total / _TICK


def cpu_times() -> list[int]:
    """The machine's CPU time since boot, in ticks, as /proc/stat's first
    line gives it: user, nice, system, idle, iowait, irq, softirq, steal."""
    return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine since boot."""
    values = cpu_times()
    idle = values[3] + values[4]
    return (sum(values) - idle) / _TICK, sum(values) / _TICK


async def backend_pids(url: str) -> list[int]:
    """Server processes of the backends connected to the database of `url`."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()")
        return [r[0] for r in await cur.fetchall()]


@dataclass
class CpuSnapshot:
    processes: dict[str, float]
    postgres: float  # the whole server (every database)
    busy: float
    total: float
    backends: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds

    @classmethod
    def take(cls, pids: dict[str, int | Sequence[int]],
             backends: Sequence[int] = ()) -> CpuSnapshot:
        """`pids`: a name's CPU is the sum over its processes."""
        busy, total = machine_cpu()
        return cls({name: sum(process_cpu(p) for p in ([pid] if isinstance(pid, int) else pid))
                    for name, pid in pids.items()},
                   postgres_cpu(), busy, total, {pid: process_cpu(pid) for pid in backends})

    @property
    def backend_total(self) -> float:
        return sum(self.backends.values())

    def minus(self, before: CpuSnapshot) -> CpuSnapshot:
        """The CPU spent between `before` and this snapshot. Backends are those
        of this snapshot: one that is new since `before` counts in full."""
        return CpuSnapshot(
            {k: v - before.processes.get(k, 0.0) for k, v in self.processes.items()},
            self.postgres - before.postgres, self.busy - before.busy,
            self.total - before.total,
            {pid: v - before.backends.get(pid, 0.0) for pid, v in self.backends.items()})


_WAL_COLUMNS = ("wal_records", "wal_fpi", "wal_bytes", "wal_write", "wal_sync")
_DB_COLUMNS = ("xact_commit", "xact_rollback", "tup_returned", "tup_fetched",
               "tup_inserted", "tup_updated", "tup_deleted", "blks_read", "blks_hit")


@dataclass
class DbSnapshot:
    database: dict[str, int]
    # schema.table -> (inserted, updated, deleted, hot updated)
    tables: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    # schema.function -> (calls, total ms, self ms); needs track_functions
    functions: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # pg_stat_wal (the whole server: the bench's machine is otherwise idle)
    wal: dict[str, float] = field(default_factory=dict)

    @classmethod
    async def take(cls, url: str) -> DbSnapshot:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT {', '.join(_DB_COLUMNS)} FROM pg_stat_database "
                "WHERE datname = current_database()")
            row = await cur.fetchone()
            database = {c: int(v or 0) for c, v in zip(_DB_COLUMNS, row, strict=True)}
            cur = await conn.execute(
                "SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_del, "
                "n_tup_hot_upd FROM pg_stat_user_tables")
            tables = {r[0]: tuple(int(v or 0) for v in r[1:]) for r in await cur.fetchall()}
            cur = await conn.execute(
                "SELECT schemaname || '.' || funcname, sum(calls), sum(total_time), "
                "sum(self_time) FROM pg_stat_user_functions GROUP BY 1")
            functions = {r[0]: tuple(float(v or 0) for v in r[1:])
                         for r in await cur.fetchall()}
            cur = await conn.execute(
                f"SELECT {', '.join(_WAL_COLUMNS)} FROM pg_stat_wal")
            row = await cur.fetchone()
            wal = {c: float(v or 0) for c, v in zip(_WAL_COLUMNS, row, strict=True)}
        # This connection's own transactions (4) are counted by the next snapshot.
        return cls(database, tables, functions, wal)

    def by_schema(self) -> dict[str, tuple[int, ...]]:
        schemas: dict[str, list[int]] = {}
        for table, values in self.tables.items():
            acc = schemas.setdefault(table.partition(".")[0], [0, 0, 0, 0])
            for i, v in enumerate(values):
                acc[i] += v
        return {k: tuple(v) for k, v in schemas.items()}

    def minus(self, before: DbSnapshot, *, own_xacts: int = 0) -> DbSnapshot:
        database = {k: v - before.database.get(k, 0) for k, v in self.database.items()}
        # The snapshot connection of `before` (4 statements) and any of the
        # benchmark's own queries are not the system's.
        database["xact_commit"] -= 4 + own_xacts
        tables = {}
        for table, values in self.tables.items():
            old = before.tables.get(table, (0, 0, 0, 0))
            tables[table] = tuple(a - b for a, b in zip(values, old, strict=True))
        functions = {}
        for name, values in self.functions.items():
            old_f = before.functions.get(name, (0.0, 0.0, 0.0))
            delta = tuple(a - b for a, b in zip(values, old_f, strict=True))
            if delta[0]:
                functions[name] = delta
        wal = {k: v - before.wal.get(k, 0.0) for k, v in self.wal.items()}
        return DbSnapshot(database, tables, functions, wal)
