"""The lease service of tree sandboxes.

A tree has one persistent workdir (`<data>/workdirs/<tree>`) and one sandbox
generation at a time: a temp area (`<data>/sandboxes/<tree>/<generation>/tmp`)
and the background processes started in it. The sandbox is released after
IDLE of inactivity — fixed here, not a setting: its temp files and processes
go, the workdir stays; the next run provisions a fresh generation.

This shares files, processes and ports between the members of a tree on
purpose; it is no isolation between parties who do not trust each other.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from psycopg_pool import AsyncConnectionPool

from yuxi import db

IDLE = dt.timedelta(minutes=5)

Clock = Callable[[], dt.datetime]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Sandbox(msgspec.Struct, frozen=True):
    tree_id: uuid.UUID
    generation: int
    workdir: Path
    tmp: Path
    # Where the tree's commands run (yuxi.runtime.confine), set by the worker.
    jail: Any = None


def locate(data_dir: str | Path, tree_id: uuid.UUID, generation: int) -> Sandbox:
    base = Path(data_dir).resolve()
    return Sandbox(tree_id=tree_id, generation=generation,
                   workdir=base / "workdirs" / str(tree_id),
                   tmp=base / "sandboxes" / str(tree_id) / str(generation) / "tmp")


async def claim(pool: AsyncConnectionPool, data_dir: str | Path, run_id: uuid.UUID,
                token: uuid.UUID, tree_id: uuid.UUID, *, now: Clock = utcnow,
                host: str | None = None) -> Sandbox:
    """The sandbox of the run's tree, provisioned (or re-provisioned after a
    release) on `host` for this run. SandboxElsewhere when it is live on
    another host."""
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "claim_sandbox",
                                 {"run_id": run_id, "token": token, "now": now(), "host": host})
    box = locate(data_dir, tree_id, row["generation"])
    box.workdir.mkdir(parents=True, exist_ok=True)
    box.tmp.mkdir(parents=True, exist_ok=True)
    return box


async def touch(pool: AsyncConnectionPool, tree_id: uuid.UUID, *, now: Clock = utcnow) -> None:
    async with pool.connection() as conn:
        await db.execute(conn, "touch_sandbox", {"tree_id": tree_id, "now": now()})


def process_identity(pid: int) -> str | None:
    """What tells this process from a later one with the same pid: the
    host's boot id and the process's start time (clock ticks since boot,
    field 22 of /proc/<pid>/stat). None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}:{fields[19]}"


def release_files_and_processes(box: Sandbox, processes: list[tuple[int, str]]) -> None:
    """The releaser: kill the generation's background processes (their
    process groups: the recorded pid leads its group) and delete its temp
    area. The workdir stays.

    A group outlives its leader while any member runs, and the kernel never
    gives a pid to a new process while a group still bears it as its id. So
    when another process holds the recorded pid now (its identity differs),
    the recorded group has no member left and the pid belongs to a stranger:
    it is left alone. When no process holds it, the group is killed if it
    still exists (a leader that exited and left members behind)."""
    for pid, identity in processes:
        now = process_identity(pid)
        if now is not None and now != identity:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(box.tmp.parent, ignore_errors=True)


async def release_idle(pool: AsyncConnectionPool, data_dir: str | Path, *, now: Clock = utcnow,
                       releaser=release_files_and_processes,
                       host: str | None = None) -> list[uuid.UUID]:
    """Release every sandbox of `host` idle for IDLE (its files and processes
    are on this host's disk: another host's are that host's to release);
    returns the trees released. Each release happens inside the transaction
    that holds the tree's sandbox lock, so no claim can see it half done."""
    at = now()
    async with pool.connection() as conn:
        idle = [r["tree_id"] for r in await db.fetch_all(conn, "idle_sandboxes",
                                                          {"before": at - IDLE, "host": host})]
    released = []
    for tree_id in idle:
        async with db.transaction(pool) as conn:
            row = await db.fetch_one(conn, "begin_sandbox_release",
                                     {"tree_id": tree_id, "now": at, "idle": IDLE})
            if row["generation"] is None:
                continue
            processes = [(r["pid"], r["identity"]) for r in await db.fetch_all(
                conn, "sandbox_processes", {"tree_id": tree_id, "generation": row["generation"]})]
            releaser(locate(data_dir, tree_id, row["generation"]), processes)
        released.append(tree_id)
    return released
