"""Throughput of the whole system versus the bare LangGraph graph.

    python -m benchmarks.run [--turns N] [--concurrency C] [--sessions S]
                             [--worker-concurrency W] [--workers P] [--rounds R]
                             [--database-url URL]

One run, one process tree, one fresh database (dropped and recreated):

(a) system: the real API (uvicorn) and P real `procrastinate worker` processes
    (default: one per core, W concurrent runs each). R rounds: each submits N
    turns over HTTP at once (C requests in flight) across S fresh sessions of
    a one-step replay agent (N / S turns each, in FIFO order) and waits for
    them; the warm-up runs on S sessions of its own. A turn's latency is the time
    from its 202 receipt (client clock) to the NOTIFY of the transaction that
    ended it (same clock: this process LISTENs on `yuxi_turns`).
    A round's turns/s = N / (its last completion - its first submission);
    the phase's rate is the median of its rounds.
(b) direct: the same graph (`build_graph`, the same replay model, a no-op
    reporter, a plain AsyncPostgresSaver per invocation) invoked R x N times
    in this process on threads mapped like the system's sessions (warm-up
    included, each thread's turns in order, so histories grow alike), C at a
    time, `durability="sync"`, after the API and the worker were stopped.
    A round's runs/s = N / its elapsed time; the median of the rounds.
(c) with --breakdown: the worker's RunExecutor.execute() in this process on N
    ready runs (no Procrastinate, no HTTP), to split the worker's overhead.

Each phase also reports CPU per turn by process (from /proc) and PostgreSQL
counters per turn (commits, rows per table, SQL function calls and times).

The report ends with one line:
    bench: system=<turns/s> direct=<runs/s> ratio=<x> p50_ms=<n> p99_ms=<n>

It is a report, never a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from benchmarks.http1 import Http1Client
from benchmarks.measure import STATS_SETTLE_SECONDS, CpuSnapshot, DbSnapshot, backend_pids

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_bench"
AGENT_CONFIG: dict[str, Any] = {"model": "replay",
                                "replay": {"default": [{"say": "ok {{ input }}"}]}}
TERMINAL_TURN_EVENTS = ("turn.completed", "turn.failed", "turn.cancelled")
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent  # the subprocesses run here


# --------------------------------------------------------------------------
# Options


@dataclass
class Options:
    url: str
    turns: int
    concurrency: int
    sessions: int
    worker_concurrency: int
    workers: int
    rounds: int
    warmup: int
    timeout: float
    profile_dir: Path | None
    keep_logs: bool
    breakdown: bool


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=400, help="measured turns / runs (N)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="client-side concurrency (C): HTTP requests in flight for the "
                        "system, graph invocations in flight for direct")
    p.add_argument("--sessions", type=int, default=64, help="sessions the turns spread over (S)")
    p.add_argument("--worker-concurrency", type=int, default=8,
                   help="YUXI_WORKER_CONCURRENCY of the worker process (W)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="worker processes (P; default: one per core, as deployed)")
    p.add_argument("--rounds", type=int, default=5,
                   help="measured rounds of N per phase (R); a phase's rate is the "
                        "median of its rounds (this machine varies by ~10%% run to run)")
    p.add_argument("--warmup", type=int, default=None,
                   help="uncounted turns/runs first, on sessions of their own (default: "
                        "N; they grow the pools to their working size and warm every "
                        "pooled connection: catalog caches, PL/pgSQL)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="give up when a phase takes longer (seconds)")
    p.add_argument("--database-url",
                   default=os.environ.get("YUXI_BENCH_DATABASE_URL", DEFAULT_URL),
                   help="database to DROP and recreate (default: $YUXI_BENCH_DATABASE_URL "
                        f"or {DEFAULT_URL})")
    p.add_argument("--profile", metavar="DIR", type=Path, default=None,
                   help="profile CPU time (cProfile) of the API, the worker, this "
                        "client and the in-process phases into DIR/<name>.prof and .txt "
                        "(slows them down: numbers of a profiled run are not comparable)")
    p.add_argument("--breakdown", action="store_true",
                   help="also run the worker's RunExecutor in this process (no "
                        "Procrastinate, no HTTP), to split the system's overhead")
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the subprocess logs even when everything went well")
    a = p.parse_args(argv)
    for name in ("turns", "concurrency", "sessions", "worker_concurrency", "workers", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.warmup is None:
        a.warmup = a.turns
    if a.warmup < 0:
        p.error("--warmup must not be negative")
    return Options(url=a.database_url, turns=a.turns, concurrency=a.concurrency,
                   sessions=a.sessions, worker_concurrency=a.worker_concurrency,
                   workers=a.workers, rounds=a.rounds,
                   warmup=a.warmup, timeout=a.timeout, profile_dir=a.profile,
                   keep_logs=a.keep_logs, breakdown=a.breakdown)


# --------------------------------------------------------------------------
# The database


async def fresh_database(url: str) -> None:
    """Drop and recreate the benchmark database, then install the schema."""
    from yuxi import db, schema

    name = db.database_name(url)
    if name in ("postgres", "template0", "template1"):
        raise SystemExit(f"bench: refusing to drop database {name!r}")
    maintenance = db.with_database(url, "postgres")
    async with await psycopg.AsyncConnection.connect(maintenance, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                           .format(sql.Identifier(name)))
    await schema.ensure_database(url)
    async with await psycopg.AsyncConnection.connect(maintenance, autocommit=True) as conn:
        # Per-function call counts and times (pg_stat_user_functions) for the
        # report; a setting of this database only, read by new connections.
        await conn.execute(sql.SQL("ALTER DATABASE {} SET track_functions = 'pl'")
                           .format(sql.Identifier(name)))
    await schema.apply_schema(url)


@contextlib.asynccontextmanager
async def exclusive(url: str) -> Any:
    """One benchmark per database at a time: a second one (which would drop
    the database under the first) waits for the first to finish. A session
    advisory lock on the server's maintenance database, held for the run."""
    from yuxi import db

    name = db.database_name(url)
    key = int.from_bytes(hashlib.sha256(f"yuxi-bench:{name}".encode()).digest()[:8], "big",
                         signed=True)
    async with await psycopg.AsyncConnection.connect(db.with_database(url, "postgres"),
                                                     autocommit=True) as conn:
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
        if not (await cur.fetchone())[0]:
            print(f"bench: another benchmark is using database {name!r}; waiting for it",
                  file=sys.stderr)
            await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        yield


async def create_key_and_agent(url: str) -> tuple[str, Any, uuid.UUID]:
    from yuxi import db
    from yuxi.services import accounts

    pool = db.app_pool(url, max_size=2)
    await pool.open(wait=True)
    try:
        key, scope = await accounts.create_key(pool, "bench", "bench")
        agent = await accounts.create_agent(pool, scope, "bench-replay", AGENT_CONFIG)
    finally:
        await pool.close()
    return key, scope, agent.id


# --------------------------------------------------------------------------
# Subprocesses


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the benchmark process dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self._log,
                                      stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_parent if sys.platform == "linux"
                                      else None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profiled(args: list[str], out: Path | None) -> list[str]:
    if out is None:
        return args
    # CPU-time cProfile: `python -m benchmarks.profile_main OUT <script | -m module> ...`
    return [str(BIN / "python"), "-m", "benchmarks.profile_main", str(out), *args]


def start_api(opts: Options, env: dict[str, str], log_dir: Path) -> tuple[Proc, str]:
    port = free_port()
    uvicorn = ["-m", "uvicorn", "--factory", "yuxi.api.app:create_app",
               "--host", "127.0.0.1", "--port", str(port),
               "--no-access-log", "--log-level", "warning",
               # The client keeps its connections across the settle pauses.
               "--timeout-keep-alive", "120"]
    if opts.profile_dir:
        args = _profiled(uvicorn, opts.profile_dir / "api.prof")
    else:
        args = [str(BIN / "python"), *uvicorn]
    return Proc("api", args, env, log_dir), f"http://127.0.0.1:{port}"


def start_worker(opts: Options, env: dict[str, str], log_dir: Path, n: int) -> Proc:
    args = [str(BIN / "procrastinate"), "--app=workers.app.app", "worker"]
    name = "worker" if opts.workers == 1 else f"worker{n + 1}"
    out = opts.profile_dir / f"{name}.prof" if opts.profile_dir else None
    return Proc(name, _profiled(args, out), env, log_dir)


async def wait_ready(base: str, procs: list[Proc], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    async with httpx.AsyncClient(base_url=base, timeout=2) as client:
        while time.monotonic() < deadline:
            for proc in procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            try:
                r = await client.get("/api/readyz")
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the API was not ready within {timeout:.0f} s: {last}")


async def settle() -> float:
    """Wait STATS_SETTLE_SECONDS for the counters to settle; return the
    machine's busy share meanwhile (load from elsewhere: other processes,
    the worker's periodic sweep), in cores."""
    before = CpuSnapshot.take({})
    await asyncio.sleep(STATS_SETTLE_SECONDS)
    after = CpuSnapshot.take({}).minus(before)
    return after.busy / STATS_SETTLE_SECONDS


def _start_profiler(opts: Options) -> Any:
    """A CPU-time profile of this process (with --profile)."""
    if not opts.profile_dir:
        return None
    import cProfile

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    return profiler


def _stop_profiler(profiler: Any, opts: Options, name: str) -> None:
    if profiler is not None and opts.profile_dir:
        profiler.disable()
        profiler.dump_stats(str(opts.profile_dir / f"{name}.prof"))


# --------------------------------------------------------------------------
# Completion watcher: LISTEN yuxi_turns, the NOTIFY of each turn's end


class CompletionWatcher:
    """Records, per turn id, the client time at which the NOTIFY of its end
    arrived: `yuxi_turns`, whose payload is the turn's id, is sent by the
    transaction that ends the turn, so its arrival is the moment the result
    is committed (plus the delivery delay), on the same clock as the
    receipt. (As a `?wait` request is woken; the trees' `yuxi_events` go
    only to watchers, yuxi.event_watches, and nobody watches here.) How each
    turn ended is read once, after the measurement (`statuses`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: dict[str, float] = {}
        self.queries = 0  # transactions this watcher ran (not the system's)
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    async def start(self) -> None:
        self._listen_conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        await self._listen_conn.execute("LISTEN yuxi_turns")
        self.queries += 1
        self._tasks = [asyncio.create_task(self._listen())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._listen_conn.close()

    async def _listen(self) -> None:
        async for note in self._listen_conn.notifies():
            self.done.setdefault(note.payload, time.perf_counter())
            self._changed.set()

    async def statuses(self, turn_ids: set[str]) -> dict[str, str]:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            cur = await conn.execute("SELECT id::text, status FROM yuxi.turns WHERE id = ANY(%s)",
                                     (list(turn_ids),))
            return dict(await cur.fetchall())

    async def wait_for(self, turn_ids: set[str], timeout: float,
                       procs: list[Proc] = ()) -> None:
        """Until every turn finished; fails at the timeout or as soon as one
        of `procs` exited."""
        deadline = time.monotonic() + timeout
        while not turn_ids.issubset(self.done.keys()):
            for proc in procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited while turns were in flight:\n"
                                       f"{proc.tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = len(turn_ids - self.done.keys())
                raise TimeoutError(f"{missing} of {len(turn_ids)} turns did not finish "
                                   f"within {timeout:.0f} s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))


# --------------------------------------------------------------------------
# (a) System


@dataclass
class SystemResult:
    turns: int  # over all rounds
    elapsed: float  # of all rounds
    round_rates: list[float]  # turns/s of each round
    latencies_ms: list[float]
    failed: int
    early: int  # completions observed before their receipt (latency clamped to 0)
    submit_elapsed: float
    receipt_ms: list[float]  # HTTP round trip of the submission
    cpu: CpuSnapshot | None = None
    db: DbSnapshot | None = None
    worker_concurrency: int = 0
    background_cores: float = 0.0
    # (system, direct, direct with its heap frozen) rates of the paired rounds
    paired: list[tuple[float, float, float]] = field(default_factory=list)


def session_of(i: int, opts: Options) -> int:
    """Which of the S x (2R + 1) sessions (direct: threads) turn i goes to:
    warm-up turn -1 - j to the first S (j mod S), turn i of round r = i // N
    (measured rounds 0..R-1, paired rounds R..2R-1) to the (r + 1)-th S
    (i mod S). Every round starts on fresh sessions, so the rounds are the
    same work, histories included (N / S turns each)."""
    if i < 0:
        return (-1 - i) % opts.sessions
    return (i // opts.turns + 1) * opts.sessions + i % opts.sessions  # r < 2R: paired too


async def _submit(clients: list[Http1Client], jobs: list[tuple[int, str]],
                  receipts: dict[int, tuple[str, float, float]]) -> None:
    """POST every job's input, one request in flight per client; record
    (turn id, send time, receipt time) per job."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def one_client(client: Http1Client) -> None:
        while True:
            try:
                i, session_id = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            sent = time.perf_counter()
            # The request id makes a resent request return the same receipt.
            body = {"content": f"turn {i}", "mode": "queue", "client_request_id": f"bench-{i}"}
            status, answer = await client.post_json(f"/api/sessions/{session_id}/inputs", body)
            received = time.perf_counter()
            if status != 202:
                raise RuntimeError(f"input {i}: HTTP {status}: {answer}")
            receipts[i] = (answer["turn_id"], sent, received)

    await asyncio.gather(*(one_client(c) for c in clients[:len(jobs)]))


async def run_system(opts: Options, key: str, agent_id: uuid.UUID,
                     log_dir: Path) -> SystemResult:
    """(a) The system's measured rounds, preceded by the paired rounds: R
    times a system round then a direct round right after it (in a process of
    its own), so both meet the same machine (this one's speed drifts by
    10-25% over minutes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_DATABASE_URL=opts.url,
               YUXI_WORKER_CONCURRENCY=str(opts.worker_concurrency),
               PYTHONUNBUFFERED="1")
    procs: list[Proc] = []
    watcher = CompletionWatcher(opts.url)
    try:
        api, base = start_api(opts, env, log_dir)
        procs.append(api)
        workers = [start_worker(opts, env, log_dir, n) for n in range(opts.workers)]
        procs.extend(workers)
        await wait_ready(base, procs)
        # One client (one kept-alive connection) per concurrent request.
        async with contextlib.AsyncExitStack() as stack:
            clients = [Http1Client(base, {"Authorization": f"Bearer {key}"})
                       for _ in range(opts.concurrency)]
            for client in clients:
                stack.push_async_callback(client.aclose)
            sessions = await _create_sessions(clients, agent_id, opts)
            await watcher.start()

            async def system_round(r: int) -> tuple[float, dict[int, tuple[str, float, float]]]:
                """Turns/s of round r, and its receipts."""
                jobs = [(i, sessions[session_of(i, opts)]) for i in round_indexes(opts, r)]
                got: dict[int, tuple[str, float, float]] = {}
                began = time.perf_counter()
                await _submit(clients, jobs, got)
                ids = {v[0] for v in got.values()}
                await watcher.wait_for(ids, opts.timeout, procs)
                return opts.turns / (max(watcher.done[t] for t in ids) - began), got

            # Warm-up (not counted): first turns of the sessions, pools grow.
            if opts.warmup:
                receipts: dict[int, tuple[str, float, float]] = {}
                jobs = [(-1 - i, sessions[session_of(-1 - i, opts)])
                        for i in range(opts.warmup)]
                await _submit(clients, jobs, receipts)
                await watcher.wait_for({r[0] for r in receipts.values()}, opts.timeout, procs)

            # Paired rounds (rates only): the API and the workers are idle
            # while the direct graph runs its round in a clean process.
            paired: list[tuple[float, float, float]] = []
            async with DirectProcess(opts, log_dir) as direct:
                await direct.warmup()
                for r in range(opts.rounds, 2 * opts.rounds):
                    system_rate, _ = await system_round(r)
                    paired.append((system_rate, await direct.round(r),
                                   await direct.round(r + opts.rounds, frozen=True)))

            # Let the counters of every backend reach pg_stat_database.
            background = await settle()
            db_before = await DbSnapshot.take(opts.url)
            queries_before = watcher.queries
            pids = {"api": api.pid, "worker": [w.pid for w in workers],
                    "bench client": os.getpid()}
            cpu_before = CpuSnapshot.take(pids, await backend_pids(opts.url))

            receipts = {}
            round_rates: list[float] = []
            profiler = _start_profiler(opts)
            start = time.perf_counter()
            for r in range(opts.rounds):
                began = time.perf_counter()
                rate, round_receipts = await system_round(r)
                if r == 0:
                    submit_elapsed = max(v[2] for v in round_receipts.values()) - began
                round_rates.append(rate)
                receipts.update(round_receipts)
            turn_ids = {r[0] for r in receipts.values()}
            _stop_profiler(profiler, opts, "client")
            backends = await backend_pids(opts.url)
            cpu = CpuSnapshot.take(pids, backends).minus(cpu_before)
        # The watcher's queries and the two backend_pids() calls.
        own_queries = watcher.queries - queries_before + 2
        await watcher.stop()
        for proc in procs:  # exiting backends flush their counters
            proc.stop()
        await asyncio.sleep(1.0)
        db = (await DbSnapshot.take(opts.url)).minus(db_before, own_xacts=own_queries)
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()
        for proc in procs:
            proc.stop()

    end = max(watcher.done[t] for t in turn_ids)
    latencies, early = [], 0
    failed = sum(status != "completed"
                 for status in (await watcher.statuses(turn_ids)).values())
    for turn_id, _sent, received in receipts.values():
        done_at = watcher.done[turn_id]
        if done_at < received:
            early += 1
        latencies.append(max(0.0, done_at - received) * 1000)
    return SystemResult(
        turns=len(receipts), elapsed=end - start, round_rates=round_rates,
        latencies_ms=latencies, failed=failed,
        early=early, submit_elapsed=submit_elapsed,
        receipt_ms=[(r[2] - r[1]) * 1000 for r in receipts.values()],
        cpu=cpu, db=db, worker_concurrency=opts.worker_concurrency,
        background_cores=background, paired=paired)


async def _create_sessions(clients: list[Http1Client], agent_id: uuid.UUID,
                           opts: Options) -> list[str]:
    free: asyncio.Queue[Http1Client] = asyncio.Queue()
    for c in clients:
        free.put_nowait(c)

    async def one(i: int) -> str:
        client = await free.get()
        try:
            status, answer = await client.post_json(
                "/api/sessions", {"agent_id": str(agent_id), "title": f"bench {i}"})
        finally:
            free.put_nowait(client)
        if status != 201:
            raise RuntimeError(f"create session: HTTP {status}: {answer}")
        return answer["id"]

    return list(await asyncio.gather(
        *(one(i) for i in range(opts.sessions * (2 * opts.rounds + 1)))))


# --------------------------------------------------------------------------
# (b) Direct


class NoopReporter:
    async def message(self, message: Any) -> None:
        return None

    async def tool_started(self, call: dict[str, Any]) -> None:
        return None

    async def tool_finished(self, call: dict[str, Any], result: str) -> None:
        return None


@dataclass
class DirectResult:
    """An in-process phase: the direct graph, or (--breakdown) RunExecutor."""
    runs: int  # over all rounds
    elapsed: float  # of all rounds
    round_rates: list[float]  # runs/s of each round
    latencies_ms: list[float]
    cpu: CpuSnapshot | None = None
    db: DbSnapshot | None = None
    background_cores: float = 0.0


async def run_concurrently(indexes: list[int], concurrency: int, fn: Any) -> list[float]:
    """Await fn(i) for every index, `concurrency` at a time; the latencies (ms)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in indexes:
        queue.put_nowait(i)
    latencies: list[float] = []

    async def one_client() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started = time.perf_counter()
            await fn(i)
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(one_client() for _ in range(min(concurrency, len(indexes)))))
    return latencies


async def measured(opts: Options, name: str, fn: Any, warmup: list[int],
                   rounds: list[list[int]]) -> DirectResult:
    """Run the warm-up, let the counters settle, then run each round of work
    measuring time, this process's CPU and the database's counters. The
    caller's pools must be closed by `fn`'s owner before the counters are
    read: pass them through `closing`."""
    await run_concurrently(warmup, opts.concurrency, fn)
    background = await settle()
    db_before = await DbSnapshot.take(opts.url)
    pids = {f"bench ({name})": os.getpid()}
    cpu_before = CpuSnapshot.take(pids, await backend_pids(opts.url))
    profiler = _start_profiler(opts)
    start = time.perf_counter()
    latencies: list[float] = []
    round_rates: list[float] = []
    for work in rounds:
        began = time.perf_counter()
        latencies += await asyncio.wait_for(run_concurrently(work, opts.concurrency, fn),
                                            opts.timeout)
        round_rates.append(len(work) / (time.perf_counter() - began))
    elapsed = time.perf_counter() - start
    _stop_profiler(profiler, opts, name)
    cpu = CpuSnapshot.take(pids, await backend_pids(opts.url)).minus(cpu_before)
    return DirectResult(runs=sum(len(w) for w in rounds), elapsed=elapsed,
                        round_rates=round_rates, latencies_ms=latencies, cpu=cpu,
                        db=db_before, background_cores=background)


async def _finish_db_stats(opts: Options, result: DirectResult) -> DirectResult:
    """After the phase's pools closed (their backends flushed their counters)."""
    await asyncio.sleep(1.0)
    assert result.db is not None
    # Own transactions: the two backend_pids() calls.
    result.db = (await DbSnapshot.take(opts.url)).minus(result.db, own_xacts=2)
    return result


class DirectGraph:
    """The worker's graph without the system: same model, same graph, a plain
    saver per invocation on the same checkpoint pool factory. Turn i runs on
    thread session_of(i), each thread's turns in order, so a run carries the
    same conversation history as the system's turn i does."""

    def __init__(self, opts: Options) -> None:
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        from yuxi import db
        from yuxi.runtime.graph import build_graph
        from yuxi.runtime.models import build_chat_model
        from yuxi.services.sessions import CONFIG_DEFAULTS

        self.AIMessage, self.HumanMessage, self.SystemMessage = (AIMessage, HumanMessage,
                                                                 SystemMessage)
        self.Saver, self.build_graph, self.build_chat_model = (AsyncPostgresSaver, build_graph,
                                                              build_chat_model)
        self.opts = opts
        self.config = {**CONFIG_DEFAULTS, **AGENT_CONFIG}
        size = opts.concurrency + 2
        self.pool = db.checkpoint_pool(opts.url, min_size=size, max_size=size)
        # Warm-up, measured, paired and frozen-heap rounds (session_of).
        self.threads = [str(uuid.uuid4()) for _ in range(opts.sessions * (3 * opts.rounds + 1))]
        self.locks = [asyncio.Lock() for _ in self.threads]

    async def __aenter__(self) -> DirectGraph:
        await self.pool.open(wait=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()

    async def invoke(self, i: int) -> None:
        t = session_of(i, self.opts)
        async with self.locks[t]:
            await self._invoke_on(self.threads[t], i)

    async def round(self, indexes: list[int]) -> float:
        """Runs/s of one round."""
        began = time.perf_counter()
        await asyncio.wait_for(run_concurrently(indexes, self.opts.concurrency, self.invoke),
                               self.opts.timeout)
        return len(indexes) / (time.perf_counter() - began)

    async def _invoke_on(self, thread_id: str, i: int) -> None:
        await self.invoke_text(thread_id, f"turn {i}")

    async def invoke_text(self, thread_id: str, text: str) -> None:
        """One turn of `text` on the thread (checked: the answer is `ok <text>`)."""
        AIMessage, HumanMessage, SystemMessage = (self.AIMessage, self.HumanMessage,
                                                  self.SystemMessage)
        config = self.config
        run_id = str(uuid.uuid4())
        session = {"id": thread_id, "name": "root", "path": "/root", "parent_id": None,
                   "tree_id": thread_id}
        model = self.build_chat_model(config["model"], config,
                                      approval_mode=config["approval_mode"], session=session)
        preamble = [SystemMessage(
            content=(f"You are Yuxi session 'root' at path /root (session id {thread_id}, "
                     f"parent none (root session), tree {thread_id}, run {run_id})."),
            id=f"identity:{run_id}")]
        graph = self.build_graph(model, {}, NoopReporter(), preamble=preamble,
                                 checkpointer=self.Saver(self.pool))
        cfg = {"configurable": {"thread_id": thread_id},
               "recursion_limit": 2 * int(config["max_steps"]) + 2}
        out = await graph.ainvoke(
            {"messages": [HumanMessage(
                content=text, id=f"input:{uuid.uuid4()}",
                # The worker's turn marker (yuxi.runtime.executor.input_message).
                additional_kwargs={"yuxi": {"turn_start": True}})]},
            cfg, durability="sync")
        last = out["messages"][-1]
        if not isinstance(last, AIMessage) or last.text != f"ok {text}":
            raise RuntimeError(f"direct run of {text!r}: unexpected answer {last!r}")


class DirectProcess:
    """The direct graph in a clean process of its own (benchmarks.direct_proc)
    for the paired rounds."""

    def __init__(self, opts: Options, log_dir: Path) -> None:
        self.opts, self.log_path = opts, log_dir / "direct.log"

    async def __aenter__(self) -> DirectProcess:
        o = self.opts
        argv = ["--database-url", o.url, "--turns", str(o.turns), "--concurrency",
                str(o.concurrency), "--sessions", str(o.sessions), "--rounds", str(o.rounds),
                "--warmup", str(o.warmup)]
        self._log = open(self.log_path, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            str(BIN / "python"), "-m", "benchmarks.direct_proc", *argv, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        await self._answer()  # ready
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
        self._log.close()

    async def _answer(self) -> str:
        line = await asyncio.wait_for(self.proc.stdout.readline(), self.opts.timeout)
        if not line:
            raise RuntimeError("the direct process exited:\n"
                               + self.log_path.read_text(errors="replace")[-3000:])
        return line.decode().strip()

    async def warmup(self) -> None:
        self.proc.stdin.write(b"warmup\n")
        await self._answer()

    async def round(self, r: int, *, frozen: bool = False) -> float:
        self.proc.stdin.write(f"{'frozen' if frozen else 'round'} {r}\n".encode())
        return float(await self._answer())


def round_indexes(opts: Options, r: int) -> list[int]:
    """Turn indexes of round r: measured rounds are 0..R-1, paired 'R..2R-1'."""
    return list(range(r * opts.turns, (r + 1) * opts.turns))


async def run_direct(opts: Options) -> DirectResult:
    """(b) The direct graph's measured rounds, alone on the machine (in this
    process: its CPU and the database's counters are measured)."""
    async with DirectGraph(opts) as direct:
        result = await measured(opts, "direct", direct.invoke,
                                [-1 - i for i in range(opts.warmup)],
                                [round_indexes(opts, r) for r in range(opts.rounds)])
    return await _finish_db_stats(opts, result)


async def run_executor(opts: Options, scope: Any, agent_id: uuid.UUID) -> DirectResult:
    """(--breakdown) The worker's RunExecutor.execute() in this process, without
    Procrastinate, HTTP or the API: one ready run per fresh session (made
    beforehand through the services, outside the measurement)."""
    from yuxi import db
    from yuxi.runtime.executor import RunExecutor
    from yuxi.services import sessions as svc
    from yuxi.settings import Settings

    settings = Settings.from_env({"YUXI_DATABASE_URL": opts.url,
                                  "YUXI_WORKER_CONCURRENCY": str(opts.worker_concurrency)})
    size = opts.concurrency + 2
    pool = db.app_pool(opts.url, min_size=size, max_size=size)
    checkpoints = db.checkpoint_pool(opts.url, min_size=size, max_size=size)
    await pool.open(wait=True)
    await checkpoints.open(wait=True)
    executor = RunExecutor(settings, pool, checkpoints)
    indexes = list(range(-opts.warmup, opts.turns))
    runs: dict[int, uuid.UUID] = {}

    async def prepare(i: int) -> None:
        session = await svc.create_session(pool, scope, agent_id=agent_id,
                                           default_model="replay")
        receipt = await svc.receive_input(pool, scope, session.id, content=f"turn {i}",
                                          mode="queue")
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM yuxi.runs WHERE turn_id = %s",
                                     (receipt.turn_id,))
            runs[i] = (await cur.fetchone())["id"]

    async def execute(i: int) -> None:
        outcome = await executor.execute(runs[i])
        if outcome != "completed":
            raise RuntimeError(f"executor run {i}: {outcome}")

    try:
        await run_concurrently(indexes, opts.concurrency, prepare)
        # Their jobs: no worker will run them, remove them.
        async with await psycopg.AsyncConnection.connect(
                db.with_search_path(opts.url, db.PROCRASTINATE_SCHEMA), autocommit=True) as conn:
            await conn.execute("DELETE FROM procrastinate_jobs "
                               "WHERE task_name = 'execute_run' AND status = 'todo'")
        result = await measured(opts, "executor", execute, [i for i in indexes if i < 0],
                                [[i for i in indexes if i >= 0]])
    finally:
        await pool.close()
        await checkpoints.close()
    return await _finish_db_stats(opts, result)


# --------------------------------------------------------------------------
# Report


def _rounds(rates: list[float]) -> str:
    return f"{len(rates)} round{'s' if len(rates) > 1 else ''} (" + \
        ", ".join(f"{r:.1f}" for r in rates) + ")"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _cpu_lines(cpu: CpuSnapshot, n: int, elapsed: float, unit: str) -> list[str]:
    lines = [f"  CPU per {unit}, and share of the {elapsed:.2f} s window:"]
    rows = [*cpu.processes.items(),
            (f"postgres backends ({len(cpu.backends)})", cpu.backend_total),
            ("postgres, rest", cpu.postgres - cpu.backend_total),
            ("other processes", cpu.busy - sum(cpu.processes.values()) - cpu.postgres)]
    for name, seconds in rows:
        lines.append(f"    {name:<24} {seconds / n * 1000:7.2f} ms   "
                     f"{seconds / elapsed * 100:5.0f}% of one core")
    cores = cpu.total / elapsed if elapsed else 0
    lines.append(f"    {'machine busy':<24} {cpu.busy / n * 1000:7.2f} ms   "
                 f"{cpu.busy / cpu.total * 100 if cpu.total else 0:5.0f}% of {cores:.0f} cores")
    return lines


def _db_lines(db: DbSnapshot, n: int, unit: str, max_functions: int = 12) -> list[str]:
    d = db.database
    lines = [f"  PostgreSQL per {unit} (tables: ins/upd/del): "
             f"{d['xact_commit'] / n:.1f} commits, "
             f"{d['xact_rollback'] / n:.1f} rollbacks, "
             f"{d['tup_inserted'] / n:.1f} rows inserted, {d['tup_updated'] / n:.1f} updated, "
             f"{d['tup_deleted'] / n:.1f} deleted, {d['tup_fetched'] / n:.0f} fetched"]
    if db.wal:
        w = db.wal
        lines.append(f"    WAL (whole server): {w['wal_sync'] / n:.1f} flushes, "
                     f"{w['wal_write'] / n:.1f} writes, {w['wal_records'] / n:.0f} records, "
                     f"{w['wal_bytes'] / n / 1024:.1f} KiB, {w['wal_fpi'] / n:.1f} full pages")
    for schema, (ins, upd, dele, hot) in sorted(db.by_schema().items()):
        if ins or upd or dele:
            lines.append(f"    {schema:<14} ins {ins / n:5.1f}  upd {upd / n:5.1f} "
                         f"(hot {hot / n:4.1f})  del {dele / n:5.1f}")
            tables = sorted(((t, v) for t, v in db.tables.items()
                             if t.startswith(schema + ".") and any(v[:3])),
                            key=lambda tv: -sum(tv[1][:3]))
            lines.append("      " + ", ".join(
                f"{t.partition('.')[2]} {'/'.join(f'{x / n:.1f}' for x in v[:3])}"
                for t, v in tables))
    if db.functions:
        lines.append(f"  SQL functions per {unit} (every call, nested ones too; wall ms "
                     "inside, with lock waits; self = without callees):")
        top = sorted(db.functions.items(), key=lambda kv: -kv[1][1])[:max_functions]
        for name, (calls, total, self_) in top:
            lines.append(f"    {name:<48} {calls / n:5.2f} calls  total {total / n:6.2f} ms  "
                         f"self {self_ / n:6.2f} ms")
    return lines


def report(opts: Options, system: SystemResult, direct: DirectResult,
           executor: DirectResult | None = None) -> str:
    # The headline numbers come from the paired rounds (each system round
    # with a direct round right after it); the separate phases below give
    # where the time goes.
    system_rate = statistics.median(p[0] for p in system.paired)
    direct_rate = statistics.median(p[1] for p in system.paired)
    ratio = statistics.median(p[0] / p[1] for p in system.paired)
    p50 = percentile(system.latencies_ms, 50)
    p99 = percentile(system.latencies_ms, 99)
    lines = [
        "Yuxi sessions benchmark",
        f"  database {opts.url}",
        f"  N={opts.turns} turns x R={opts.rounds} rounds  concurrency C={opts.concurrency}  "
        f"sessions S={opts.sessions} per round  worker processes P={opts.workers}  "
        f"worker concurrency W={opts.worker_concurrency}  warm-up {opts.warmup}  "
        f"cores {os.cpu_count()}",
        "",
        "paired rounds (a system round, then direct rounds right after it in a clean process):",
        "  system turns/s            " + "  ".join(f"{p[0]:7.1f}" for p in system.paired),
        "  direct runs/s             " + "  ".join(f"{p[1]:7.1f}" for p in system.paired),
        "  ratio                     " + "  ".join(f"{p[0] / p[1]:7.2f}" for p in system.paired),
        "  direct, heap frozen       " + "  ".join(f"{p[2]:7.1f}" for p in system.paired),
        "  ratio to it               " + "  ".join(f"{p[0] / p[2]:7.2f}" for p in system.paired),
        f"  medians: system {system_rate:.1f}  direct {direct_rate:.1f}  ratio {ratio:.2f}  "
        f"(direct with the worker's frozen heap (yuxi.heap): "
        f"{statistics.median(p[2] for p in system.paired):.1f}, ratio "
        f"{statistics.median(p[0] / p[2] for p in system.paired):.2f})",
        "",
        f"(a) system: API + {opts.workers} worker process{'es' if opts.workers > 1 else ''}, "
        "HTTP submissions, completion by NOTIFY",
        f"  {statistics.median(system.round_rates):.1f} turns/s, the median of "
        f"{_rounds(system.round_rates)}  "
        f"({system.turns} turns in {system.elapsed:.2f} s; the {opts.turns} of round 1 "
        f"submitted in {system.submit_elapsed:.2f} s)",
        f"  receipt-to-result latency ms: p50 {p50:.0f}  p90 "
        f"{percentile(system.latencies_ms, 90):.0f}  p99 {p99:.0f}  max "
        f"{max(system.latencies_ms):.0f}",
        f"  submission (HTTP 202) ms: p50 {percentile(system.receipt_ms, 50):.0f}  "
        f"p99 {percentile(system.receipt_ms, 99):.0f}",
    ]
    if system.failed:
        lines.append(f"  WARNING: {system.failed} turns did not complete")
    if system.early:
        lines.append(f"  note: {system.early} turns finished before their 202 was read "
                     "(latency counted as 0)")
    lines.append(f"  machine load just before (idle system): {system.background_cores:.2f} cores")
    if system.cpu:
        lines += _cpu_lines(system.cpu, system.turns, system.elapsed, "turn")
    if system.db:
        lines += _db_lines(system.db, system.turns, "turn")
    lines += [
        "",
        "(b) direct: the same graph + AsyncPostgresSaver in one process",
        f"  {statistics.median(direct.round_rates):.1f} runs/s, the median of "
        f"{_rounds(direct.round_rates)}  "
        f"({direct.runs} runs in {direct.elapsed:.2f} s)  "
        f"invocation ms: p50 {percentile(direct.latencies_ms, 50):.0f}  "
        f"p99 {percentile(direct.latencies_ms, 99):.0f}",
    ]

    lines.append(f"  machine load just before: {direct.background_cores:.2f} cores")
    if direct.cpu:
        lines += _cpu_lines(direct.cpu, direct.runs, direct.elapsed, "run")
    if direct.db:
        lines += _db_lines(direct.db, direct.runs, "run")
    if executor is not None:
        lines += [
            "",
            "(c) breakdown: RunExecutor.execute() in one process (no Procrastinate, no HTTP)",
            f"  {executor.runs / executor.elapsed:.1f} runs/s  ({executor.runs} runs in "
            f"{executor.elapsed:.2f} s)  run ms: p50 "
            f"{percentile(executor.latencies_ms, 50):.0f}  "
            f"p99 {percentile(executor.latencies_ms, 99):.0f}",
            f"  machine load just before: {executor.background_cores:.2f} cores",
        ]
        if executor.cpu:
            lines += _cpu_lines(executor.cpu, executor.runs, executor.elapsed, "run")
        if executor.db:
            lines += _db_lines(executor.db, executor.runs, "run")
        if system.cpu and direct.cpu and executor.cpu:
            graph = next(iter(direct.cpu.processes.values())) / direct.runs * 1000
            execu = next(iter(executor.cpu.processes.values())) / executor.runs * 1000
            worker = system.cpu.processes["worker"] / system.turns * 1000
            lines += [
                "  worker CPU per turn, split:",
                f"    graph (direct)                 {graph:7.2f} ms",
                f"    + RunExecutor around it        {execu - graph:7.2f} ms",
                f"    + Procrastinate, loop, rest    {worker - execu:7.2f} ms",
                f"    = worker                       {worker:7.2f} ms",
            ]
    lines += [
        "",
    ]
    loads = [system.background_cores, direct.background_cores,
             executor.background_cores if executor else 0.0]
    if max(loads) > 0.25:
        lines.append("WARNING: the machine was busy with other work (see 'machine load'); "
                     "the numbers are noisy: rerun on a quiet machine")
    lines += [
        f"ratio system/direct = {ratio:.2f}, the median of the paired rounds' "
        f"(target >= 0.80: "
        f"{'met' if ratio >= 0.8 else 'NOT met'})",
        f"bench: system={system_rate:.1f} direct={direct_rate:.1f} ratio={ratio:.2f} "
        f"p50_ms={round(p50)} p99_ms={round(p99)}",
    ]
    return "\n".join(lines)


def write_profiles(profile_dir: Path) -> None:
    import pstats

    for name in ("api", "worker", "client", "direct", "executor"):
        prof = profile_dir / f"{name}.prof"
        if not prof.exists():
            continue
        with open(profile_dir / f"{name}.txt", "w") as out:
            stats = pstats.Stats(str(prof), stream=out)
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats(80)


async def main_async(opts: Options) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="yuxi-bench-"))
    if opts.profile_dir:
        opts.profile_dir.mkdir(parents=True, exist_ok=True)
    async with exclusive(opts.url):
        return await _main_locked(opts, log_dir)


async def _main_locked(opts: Options, log_dir: Path) -> int:
    print(f"bench: fresh database {opts.url} ...", file=sys.stderr)
    await fresh_database(opts.url)
    key, scope, agent_id = await create_key_and_agent(opts.url)
    print(f"bench: system phase (logs in {log_dir}) ...", file=sys.stderr)
    try:
        system = await run_system(opts, key, agent_id, log_dir)
    except BaseException:
        print(f"bench: the system phase failed; logs in {log_dir}", file=sys.stderr)
        raise
    print("bench: direct phase ...", file=sys.stderr)
    direct = await run_direct(opts)
    executor = None
    if opts.breakdown:
        print("bench: executor phase ...", file=sys.stderr)
        executor = await run_executor(opts, scope, agent_id)
    if opts.profile_dir:
        write_profiles(opts.profile_dir)
    if not opts.keep_logs and not system.failed:
        for path in log_dir.iterdir():
            path.unlink()
        log_dir.rmdir()
    print(report(opts, system, direct, executor))
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    # SIGTERM ends the benchmark like Ctrl-C: the finally blocks stop the
    # subprocesses.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(main_async(opts))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
