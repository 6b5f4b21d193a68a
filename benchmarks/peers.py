"""Yuxi and a peer (DBOS Transact 3.4) on the same workload, one after the
other in one run (issue 15, item 2).

    python -m benchmarks.peers [--turns 300] [--sessions 50] [--clients 8]
                               [--sequential 40] [--database-url URL]
                               [--dbos-database-url URL] [--skip-dbos]
                               [--yuxi-protocol wait|sse|both]

The workload: 300 turns over 50 sessions by 8 HTTP clients (each client
takes the next turn; turn k goes to session k mod 50, so a session's turns
come in order), a one-step replay agent answering `ok <input>`; then the
sequential latency of one client (--sequential turns over 5 sessions).

- Yuxi: the real API (uvicorn) and 2 `procrastinate worker` processes
  (benchmarks.run starts them: one per core, worker concurrency 8) on a
  fresh database. A turn is one of two protocols (--yuxi-protocol, default
  both, one after the other on fresh services; the first is the one
  compared with DBOS):
  - wait: POST /api/sessions/{id}/inputs?wait=60, which answers with the
    receipt and the turn's terminal result (one request);
  - sse: POST /api/sessions/{id}/inputs, then the SSE stream GET
    /api/sessions/{id}/events?after=<the session's last seen event> until
    this turn's `turn.completed`, then GET /api/turns/{turn}/result.
- DBOS: benchmarks.peers_dbos (uvicorn, one process): the same graph, the
  same replay model and an AsyncPostgresSaver checkpointer run by a DBOS
  workflow on a queue of global concurrency 4 polled every 0.05 s, its own
  database. A turn = POST /turns (enqueue), then GET /turns/{id}/result
  (DBOS's handle.get_result(), waiting for the workflow).

Every side's client is benchmarks.http1's lean HTTP/1.1 client, one
kept-alive connection per client (the SSE stream on one of its own): it
shares the two cores with the system it measures, and httpx took ~1.5 ms
more of a sequential turn than it.

Each side gets a warm-up of 16 turns on sessions of their own first.
turns/s = turns / (first POST to last result). Latency = POST sent to
result read. Targets: Yuxi >= 2x DBOS's turns/s, Yuxi's sequential p50
<= 0.5x DBOS's.

A report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
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

from benchmarks import run as bench
from benchmarks.http1 import Http1Client
from benchmarks.measure import CpuSnapshot, backend_pids

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_peers"
DEFAULT_DBOS_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_peers_dbos"
WARMUP = 16


@dataclass
class Side:
    name: str
    turns: int = 0
    elapsed: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    sequential_ms: list[float] = field(default_factory=list)
    busy_cores: float = 0.0
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU per turn by part
    error: str | None = None

    @property
    def server_ms(self) -> float:
        """CPU per turn of the system (its processes and its database's
        backends; not the load generator)."""
        return self.cpu_ms.get("server processes", 0.0) + self.cpu_ms.get("postgres backends", 0.0)

    @property
    def rate(self) -> float:
        return self.turns / self.elapsed if self.elapsed else float("nan")

    @property
    def seq_p50(self) -> float:
        return statistics.median(self.sequential_ms) if self.sequential_ms else float("nan")


async def drive(turn_fn: Any, sessions: list[str], n: int, clients: int) -> tuple[float,
                                                                                   list[float]]:
    """n turns, turn k on sessions[k % len], `clients` at a time; elapsed
    seconds and each turn's latency (ms)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(n):
        queue.put_nowait(k)
    latencies: list[float] = []

    async def client(c: int) -> None:
        while True:
            try:
                k = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t = time.perf_counter()
            await turn_fn(c, sessions[k % len(sessions)], f"turn {k}")
            latencies.append((time.perf_counter() - t) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - began, latencies


async def measure_side(side: Side, turn_fn: Any, make_sessions: Any, opts: Any,
                       server_pids: list[int], url: str, *, client: bool = True) -> None:
    """`client`: the load generator is this process, apart from the server
    processes (the direct side is this process: no client apart)."""
    warm = await make_sessions(WARMUP)
    await drive(turn_fn, warm, WARMUP, opts.clients)
    sessions = await make_sessions(opts.sessions)
    pids = {"server processes": server_pids, "client": os.getpid() if client else []}
    before = CpuSnapshot.take(pids, await backend_pids(url))
    side.elapsed, side.latencies_ms = await asyncio.wait_for(
        drive(turn_fn, sessions, opts.turns, opts.clients), opts.timeout)
    cpu = CpuSnapshot.take(pids, await backend_pids(url)).minus(before)
    side.busy_cores = cpu.busy / side.elapsed
    side.cpu_ms = {**{k: v / opts.turns * 1000 for k, v in cpu.processes.items()},
                   "postgres backends": cpu.backend_total / opts.turns * 1000}
    side.turns = opts.turns
    seq_sessions = await make_sessions(5)
    _, side.sequential_ms = await asyncio.wait_for(
        drive(turn_fn, seq_sessions, opts.sequential, 1), opts.timeout)


# --------------------------------------------------------------------------
# Yuxi


class YuxiClient:
    def __init__(self, base: str, key: str, agent_id: uuid.UUID, clients: int) -> None:
        self.http = [Http1Client(base, {"Authorization": f"Bearer {key}"})
                     for _ in range(clients)]
        self.agent_id = agent_id
        self.cursors: dict[str, int] = {}

    async def aclose(self) -> None:
        for h in self.http:
            await h.aclose()

    async def sessions(self, n: int) -> list[str]:
        out = []
        for i in range(n):
            status, body = await self.http[0].post_json(
                "/api/sessions", {"agent_id": str(self.agent_id), "title": f"peers {i}"})
            if status != 201:
                raise RuntimeError(f"POST session: {status} {body}")
            out.append(body["id"])
        return out

    async def turn_wait(self, c: int, session: str, text: str) -> None:
        status, body = await self.http[c].post_json(
            f"/api/sessions/{session}/inputs?wait=60", _input(session, text))
        if status != 202:
            raise RuntimeError(f"POST input?wait: {status} {body}")
        check_result(body["result"], text)

    async def turn_sse(self, c: int, session: str, text: str) -> None:
        http = self.http[c]
        status, body = await http.post_json(f"/api/sessions/{session}/inputs",
                                            _input(session, text))
        if status != 202:
            raise RuntimeError(f"POST input: {status} {body}")
        turn_id = body["turn_id"]
        after = self.cursors.get(session, 0)
        done = False
        async with contextlib.aclosing(
                http.sse_events(f"/api/sessions/{session}/events?after={after}")) as events:
            async for event in events:
                self.cursors[session] = max(self.cursors.get(session, 0), event["seq"])
                if event["turn_id"] == turn_id and event["type"] in bench.TERMINAL_TURN_EVENTS:
                    done = True
                    break
        if not done:
            raise RuntimeError(f"the event stream ended before turn {turn_id} did")
        status, body = await http.get_json(f"/api/turns/{turn_id}/result")
        if status != 200:
            raise RuntimeError(f"GET result: {status} {body}")
        check_result(body, text)


def _input(session: str, text: str) -> dict[str, str]:
    """A turn's input; its request id makes a resent POST the same input."""
    return {"content": text, "mode": "queue", "client_request_id": f"{session} {text}"}


def check_result(result: dict[str, Any] | None, text: str) -> None:
    if (result is None or result["status"] != "completed"
            or result["output"]["text"] != f"ok {text}"):
        raise RuntimeError(f"turn of {text!r}: {result}")


PROTOCOLS = {"wait": "Yuxi (POST ?wait)", "sse": "Yuxi (POST, SSE, GET result)"}


async def run_yuxi(opts: Any, log_dir: Path, protocol: str) -> Side:
    side = Side(PROTOCOLS[protocol])
    run_opts = bench.parse_args(["--database-url", opts.database_url, "--workers", "2",
                                 "--worker-concurrency", "8"])
    await bench.fresh_database(opts.database_url)
    key, _scope, agent_id = await bench.create_key_and_agent(opts.database_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_DATABASE_URL=opts.database_url, YUXI_WORKER_CONCURRENCY="8",
               PYTHONUNBUFFERED="1")
    procs: list[bench.Proc] = []
    try:
        api, base = bench.start_api(run_opts, env, log_dir)
        procs.append(api)
        procs += [bench.start_worker(run_opts, env, log_dir, n) for n in range(2)]
        await bench.wait_ready(base, procs)
        client = YuxiClient(base, key, agent_id, opts.clients)
        try:
            turn = client.turn_wait if protocol == "wait" else client.turn_sse
            await measure_side(side, turn, client.sessions, opts,
                               [p.pid for p in procs], opts.database_url)
        finally:
            await client.aclose()
    finally:
        for proc in procs:
            proc.stop()
    return side


# --------------------------------------------------------------------------
# The bare graph


async def run_direct(opts: Any, name: str) -> Side:
    """The same graph in this process, no HTTP and no queue (as benchmarks.run's
    direct side: a plain saver per invocation on a pool like the worker's), on
    Yuxi's database; the reference of the sequential-latency target."""
    side = Side(name)
    run_opts = bench.parse_args(["--database-url", opts.database_url,
                                 "--concurrency", str(opts.clients)])
    async with bench.DirectGraph(run_opts) as direct:
        locks: dict[str, asyncio.Lock] = {}

        async def turn(_c: int, session: str, text: str) -> None:
            async with locks.setdefault(session, asyncio.Lock()):  # a thread's turns in order
                await direct.invoke_text(session, text)

        async def sessions(n: int) -> list[str]:
            return [str(uuid.uuid4()) for _ in range(n)]

        await measure_side(side, turn, sessions, opts, [os.getpid()], opts.database_url,
                           client=False)
    return side


# --------------------------------------------------------------------------
# DBOS


async def fresh_dbos_database(url: str) -> None:
    from yuxi import db, schema

    name = db.database_name(url)
    if name in ("postgres", "template0", "template1"):
        raise SystemExit(f"peers: refusing to drop database {name!r}")
    async with await psycopg.AsyncConnection.connect(db.with_database(url, "postgres"),
                                                     autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                           .format(sql.Identifier(name)))
    await schema.ensure_database(url)
    await schema._setup_checkpointer(url)  # LangGraph's tables, schema langgraph


class DbosClient:
    def __init__(self, base: str, clients: int) -> None:
        self.http = [Http1Client(base, {}) for _ in range(clients)]

    async def aclose(self) -> None:
        for h in self.http:
            await h.aclose()

    async def sessions(self, n: int) -> list[str]:
        return [str(uuid.uuid4()) for _ in range(n)]

    async def turn(self, c: int, session: str, text: str) -> None:
        http = self.http[c]
        status, body = await http.post_json("/turns", {"session_id": session, "text": text})
        if status != 202:
            raise RuntimeError(f"POST turn: {status} {body}")
        status, body = await http.get_json(f"/turns/{body['id']}/result")
        if status != 200 or body["text"] != f"ok {text}":
            raise RuntimeError(f"DBOS turn: {status} {body}")


async def run_dbos(opts: Any, log_dir: Path) -> Side:
    side = Side("DBOS 3.4")
    try:
        import dbos  # noqa: F401
    except ImportError as exc:
        side.error = f"dbos is not installed ({exc}): `make bench-peers` installs the bench extra"
        return side
    await fresh_dbos_database(opts.dbos_database_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(PEERS_DBOS_DATABASE_URL=opts.dbos_database_url, PYTHONUNBUFFERED="1")
    port = bench.free_port()
    proc = bench.Proc("dbos", [str(bench.BIN / "python"), "-m", "uvicorn", "--factory",
                               "benchmarks.peers_dbos:create_app", "--host", "127.0.0.1",
                               "--port", str(port), "--no-access-log", "--log-level",
                               "warning", "--timeout-keep-alive", "120"], env, log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=base, timeout=2) as probe:
            while True:
                if not proc.alive():
                    raise RuntimeError(f"the DBOS app exited:\n{proc.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get("/readyz")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the DBOS app was not ready:\n{proc.tail()}")
                await asyncio.sleep(0.2)
        client = DbosClient(base, opts.clients)
        try:
            await measure_side(side, client.turn, client.sessions, opts, [proc.pid],
                               opts.dbos_database_url)
        finally:
            await client.aclose()
    except Exception as exc:
        side.error = f"{type(exc).__name__}: {exc}\n{proc.tail()}"
    finally:
        proc.stop()
    return side


# --------------------------------------------------------------------------


def report(opts: Any, sides: list[Side], direct: list[Side]) -> str:
    lines = [f"Peers' workload: {opts.turns} turns over {opts.sessions} sessions by "
             f"{opts.clients} HTTP clients; sequential: {opts.sequential} turns by one "
             f"client; {os.cpu_count()} vCPUs", "",
             "| system | turns/s | latency p50 ms | p99 ms | sequential p50 ms | "
             "machine busy (cores) | CPU ms per turn: server processes + PostgreSQL "
             "backends (client) | turns/s per core of that CPU |",
             "|---|---|---|---|---|---|---|---|"]
    for s in [direct[0], *sides, direct[-1]]:
        if s.error:
            lines.append(f"| {s.name} | failed: {s.error.splitlines()[0]} | | | | | | |")
            continue
        lines.append(f"| {s.name} | {s.rate:.1f} | {bench.percentile(s.latencies_ms, 50):.0f} | "
                     f"{bench.percentile(s.latencies_ms, 99):.0f} | {s.seq_p50:.1f} | "
                     f"{s.busy_cores:.2f} | {s.cpu_ms['server processes']:.1f} + "
                     f"{s.cpu_ms['postgres backends']:.1f} = {s.server_ms:.1f} "
                     f"({s.cpu_ms['client']:.1f}) | {1000 / s.server_ms:.0f} |")
    yuxi, peer = sides[0], sides[-1]
    if peer.name.startswith("DBOS") and not yuxi.error and not peer.error:
        tr = yuxi.rate / peer.rate
        lr = yuxi.seq_p50 / peer.seq_p50
        lines += ["", f"peers: yuxi={yuxi.rate:.1f} turns/s dbos={peer.rate:.1f} turns/s "
                      f"ratio={tr:.2f} (target >= 2: {'met' if tr >= 2 else 'NOT met'}); "
                      f"sequential p50 yuxi={yuxi.seq_p50:.1f} ms dbos={peer.seq_p50:.1f} ms "
                      f"ratio={lr:.2f} (target <= 0.5: {'met' if lr <= 0.5 else 'NOT met'}); "
                      f"CPU per turn yuxi={yuxi.server_ms:.1f} ms dbos={peer.server_ms:.1f} ms "
                      f"(capacity ratio {peer.server_ms / yuxi.server_ms:.2f})"]
    if not yuxi.error:
        base = statistics.mean(d.seq_p50 for d in direct)
        dr = yuxi.seq_p50 / base
        lines += ["", f"sequential p50: {yuxi.name} {yuxi.seq_p50:.1f} ms, the bare graph "
                      f"{' and '.join(f'{d.seq_p50:.1f}' for d in direct)} ms (start, end): "
                      f"ratio={dr:.2f} (target <= 2: {'met' if dr <= 2 else 'NOT met'})"]
    for s in sides:
        if s.error:
            lines += ["", f"{s.name} failed:", s.error]
    return "\n".join(lines)


async def main_async(opts: Any) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="yuxi-peers-"))
    protocols = ["wait", "sse"] if opts.yuxi_protocol == "both" else [opts.yuxi_protocol]
    # The bare graph at the start and at the end (this machine's speed drifts).
    print("peers: the bare graph ...", file=sys.stderr)
    await bench.fresh_database(opts.database_url)
    first = await run_direct(opts, "bare graph, in-process (start)")
    sides = []
    for protocol in protocols:
        print(f"peers: {PROTOCOLS[protocol]} (logs in {log_dir}) ...", file=sys.stderr)
        sides.append(await run_yuxi(opts, log_dir, protocol))
    print("peers: the bare graph again ...", file=sys.stderr)
    last = await run_direct(opts, "bare graph, in-process (end)")
    if not opts.skip_dbos:
        print("peers: DBOS ...", file=sys.stderr)
        sides.append(await run_dbos(opts, log_dir))
    print(report(opts, sides, [first, last]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--sequential", type=int, default=40)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--database-url", default=os.environ.get("YUXI_PEERS_DATABASE_URL",
                                                            DEFAULT_URL))
    p.add_argument("--dbos-database-url", default=os.environ.get("YUXI_PEERS_DBOS_DATABASE_URL",
                                                                 DEFAULT_DBOS_URL))
    p.add_argument("--skip-dbos", action="store_true")
    p.add_argument("--yuxi-protocol", choices=["wait", "sse", "both"], default="both")
    opts = p.parse_args(argv)
    return asyncio.run(main_async(opts))


if __name__ == "__main__":
    sys.exit(main())
