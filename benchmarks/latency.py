"""Fan-out, wake and SSE fan-in latency (issue 15), through the real API and
real workers on a fresh database.

    python -m benchmarks.latency [--scenarios fanout,chain,wake,sse] [--children 64]
        [--delay-ms 200] [--waits 50] [--subscribers 500] [--turns 20] [--interval 1]
        [--database-url URL]

1. Fan-out: a root session's replay script creates --children child
   sessions (`create_session`) whose turn takes --delay-ms each, waits for
   all of them (`wait_inputs`) and answers. A tree has 4 slots, so the ideal
   is children x delay / 4. Elapsed = the root's input receipt
   (`yuxi.inputs.created_at`) to its `turn.completed` (`created_at`), both
   the database's clock. A warm-up fan-out, then --fanouts measured ones
   (3) one after the other, each reported, and their median and range
   (this machine's speed wanders between runs); target: elapsed <= 1.1 x
   ideal.
   Each line also gives the root's first run in phases (lease, the
   create's answer, the children created, the results saved, the
   suspension that frees the last chain's slot) and the fan-out's chains
   (the children one slot ran, each handed over by its predecessor):
   start, children, mean cycle.
   The chain scenario: the same fan-out of --chain-children (24)
   on a tree of one slot, warm-up and --fanouts measured: one chain alone,
   the least a child's slot costs beyond its model's delay here, without
   the contention of four chains. With both, a last line puts the
   fan-out's floor on this machine (fan_out_floor): its chains cycling as
   the lone one does.
2. Wake: --waits root sessions, one after the other, each turn creating one
   child (a 200 ms step, so the parent has suspended by then) and waiting
   for it. Wake = the child's `turn.completed` to the parent's resumed
   `run.started` (events' `created_at`, `clock_timestamp()` at insert).
   Target: p99 <= 10 ms.
3. SSE fan-in: --subscribers event streams of one session on one API
   process (a lean asyncio client: one socket and a protocol object each,
   bytes time-stamped as they arrive, parsed after the run), --turns turns
   one after the other. For every frame at every subscriber: its arrival
   minus its event's `created_at` (the insert; the commit follows within
   the transaction), and minus the arrival of the first `yuxi_events`
   NOTIFY at the bench's own LISTEN connection after that insert (the
   commit as seen by a listener). Target: p99 <= 20 ms. Run with the
   default feed and with YUXI_SSE_FEED_EVENTS=0 (each subscriber reads the
   table itself), each with the turns back to back and with a turn every
   --interval s (1); a run ends when no byte arrived for 2 s. Also the API
   process's CPU over the run per frame delivered, and first the floor: a
   bare asyncio loop's pass writing one chunk to each of --subscribers
   loopback sockets (`write_floor`), which no delivery can beat, and when
   that pass's bytes reach a lean reader in another process (the least a
   frame's delay from its NOTIFY can be).

Services: the API (uvicorn) and 2 `procrastinate worker` processes (worker
concurrency 8) as benchmarks.run starts them, restarted on a fresh database
(default `yuxi_bench_latency`, DROPPED and recreated) for each scenario.
A report, not a test: it exits 0 whatever the numbers are.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gc
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

from benchmarks import measure, run as bench

DEFAULT_DB = "yuxi_bench_latency"
SLOTS = 4


def pct(values: list[float], q: float) -> float:
    return bench.percentile(values, q * 100) if values else float("nan")


@contextlib.asynccontextmanager
async def services(url: str, log_dir: Path, extra_env: dict[str, str] | None = None,
                   workers: int = 2) -> Any:
    """A fresh database, a key, the API and `workers` workers; yields
    (base URL, an httpx client with the key)."""
    await bench.fresh_database(url)
    key, _scope, _agent = await bench.create_key_and_agent(url)
    profile = ["--profile", str(services.profile_dir)] if services.profile_dir else []
    opts = bench.parse_args(["--database-url", url, "--workers", str(workers),
                             "--worker-concurrency", "8", *profile])
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_DATABASE_URL=url, YUXI_WORKER_CONCURRENCY="8", PYTHONUNBUFFERED="1",
               **(extra_env or {}))
    procs: list[bench.Proc] = []
    try:
        api, base = bench.start_api(opts, env, log_dir)
        procs.append(api)
        procs += [bench.start_worker(opts, env, log_dir, n) for n in range(workers)]
        await bench.wait_ready(base, procs)
        async with httpx.AsyncClient(base_url=base, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            services.api_pid = api.pid
            yield base, key, http
    finally:
        for p in procs:
            p.stop()


services.profile_dir = None  # type: ignore[attr-defined]


async def new_session(http: httpx.AsyncClient, script: dict[str, Any],
                      tools: list[str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"model": "replay", "replay": script}
    if tools:
        config["tools"] = tools
    r = await http.post("/api/agents", json={"name": f"a{time.monotonic_ns()}",
                                             "config": config})
    assert r.status_code == 201, r.text
    r = await http.post("/api/sessions", json={"agent_id": r.json()["id"]})
    assert r.status_code == 201, r.text
    return r.json()


async def post(http: httpx.AsyncClient, session_id: str, text: str) -> dict[str, Any]:
    r = await http.post(f"/api/sessions/{session_id}/inputs",
                        json={"content": text, "mode": "queue"})
    assert r.status_code == 202, r.text
    return r.json()


async def wait_turn(conn: psycopg.AsyncConnection, tree: str, turn: str,
                    timeout: float = 300.0) -> str:
    """The terminal event type of `turn`, woken by the turn's own
    notification (`yuxi_turns`, as the API's `?wait` is) rather than by
    polling: a poll every 20 ms woke a backend 50 times a second in the
    middle of the measured runs. (`conn`: autocommit; it keeps listening.)"""
    await conn.execute("LISTEN yuxi_turns")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = await conn.execute(
            "SELECT type FROM yuxi.events WHERE tree_id = %s AND turn_id = %s AND type = ANY(%s)",
            (tree, turn, list(bench.TERMINAL_TURN_EVENTS)))
        row = await cur.fetchone()
        if row:
            return row[0]
        async for note in conn.notifies(timeout=1.0):
            if note.payload == str(turn):
                break
    raise RuntimeError(f"turn {turn} did not end within {timeout:.0f} s")


# --------------------------------------------------------------------------
# 1. Fan-out


def fan_out_script(children: int, delay_ms: int) -> dict[str, Any]:
    create = [{"tool": "create_session", "args": {"name": f"c{i}", "task": f"task {i}"}}
              for i in range(children)]
    return {
        "rules": [{"match": "^fan out", "steps": [
            {"call": create},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}",
                "timeout_s": 600}}]},
            {"say": "done {{ results|length }}"},
        ]}],
        "default": [{"say": "result of {{ input }}", "delay_ms": delay_ms}],
    }


async def fan_outs(args: Any, log_dir: Path, children: int, slots: int = SLOTS) -> Any:
    """A scenario's fan-outs of `children` on trees of `slots` slots, one
    after the other on the same services: a warm-up, then --fanouts
    measured. Yields (attempt, conn, root, receipt, the root turn's terminal
    event, the machine's CPU shares meanwhile) as each one ends."""
    attempts = ["warm-up", *(f"measured {k + 1} of {args.fanouts}" for k in range(args.fanouts))]
    async with services(args.database_url, log_dir, workers=args.workers) as (_base, _key, http):
        async with await psycopg.AsyncConnection.connect(args.database_url,
                                                         autocommit=True) as conn:
            for attempt in attempts:
                root = await new_session(http, fan_out_script(children, args.delay_ms),
                                         ["cooperation"])
                if slots != SLOTS:
                    await conn.execute("UPDATE yuxi.trees SET slot_capacity = %s WHERE id = %s",
                                       (slots, root["tree_id"]))
                cpu = CpuTime()
                receipt = await post(http, root["id"], "fan out")
                status = await wait_turn(conn, root["tree_id"], receipt["turn_id"])
                yield attempt, conn, root, receipt, status, cpu.shares()


async def scenario_fanout(args: Any, log_dir: Path) -> list[str]:
    ideal = args.children * args.delay_ms / 1000 / SLOTS
    lines = []
    ratios: list[float] = []
    async for attempt, conn, root, receipt, status, machine in fan_outs(args, log_dir,
                                                                        args.children):
        cur = await conn.execute(
            """SELECT extract(epoch FROM e.created_at - i.created_at),
                      (SELECT count(*) FROM yuxi.events c WHERE c.tree_id = e.tree_id
                         AND c.session_id <> e.session_id AND c.type = 'turn.completed'),
                      (SELECT extract(epoch FROM max(c.created_at) - min(c.created_at))
                         FROM yuxi.events c WHERE c.tree_id = e.tree_id
                         AND c.session_id <> e.session_id
                         AND c.type IN ('run.started', 'turn.completed'))
                 FROM yuxi.events e JOIN yuxi.inputs i ON i.id = %s
                WHERE e.tree_id = %s AND e.turn_id = %s AND e.type = %s""",
            (receipt["input_id"], root["tree_id"], receipt["turn_id"], status))
        elapsed, done, span = await cur.fetchone()
        elapsed, span = float(elapsed), float(span or 0)
        parts, resume = await fan_out_parts(conn, root, receipt, args.delay_ms)
        found = await chain_cycles(conn, root, receipt, args.delay_ms)
        chains = "; chains (start ms, children, mean cycle over the delay): " + ", ".join(
            f"+{start:.0f}/{len(cycles) + 1}/+{mean_cycle(cycles):.1f}"
            for start, cycles in found)
        line = (f"fan-out ({attempt}): {args.children} children x {args.delay_ms} ms "
                f"on {SLOTS} slots: elapsed {elapsed:.3f} s, ideal {ideal:.3f} s, "
                f"ratio {elapsed / ideal:.2f} (target <= 1.10); children's first "
                f"run.started to last turn.completed {span:.3f} s; "
                f"{done} children completed; root turn {status}; {parts}{chains}; "
                f"{machine}")
        print(line, flush=True)
        lines.append(line)
        if attempt != "warm-up":
            ratios.append(elapsed / ideal)
            if found:
                FLOOR_PARTS.append(([(start, len(cycles) + 1) for start, cycles in found],
                                    resume))
    if ratios:
        line = (f"fan-out: {args.children} children x {args.delay_ms} ms on {SLOTS} slots, "
                f"{len(ratios)} measured: ratio median {statistics.median(ratios):.2f}, range "
                f"{min(ratios):.2f}-{max(ratios):.2f} (target <= 1.10)")
        print(line, flush=True)
        lines.append(line)
    return lines


async def fan_out_parts(conn: psycopg.AsyncConnection, root: dict[str, Any],
                        receipt: dict[str, Any], delay_ms: int) -> tuple[str, float]:
    """Where a fan-out's time beyond the ideal went: the root's first run
    (its input to its suspension, when its slot goes to the last chain)
    and its phases (`first_phases`), a child's run beyond its model's
    delay (p50 and p90, from its lease to its completion), the root's
    resumed run (the last child's end to the root's), and the runs each
    worker process executed (runs.claimer); and the resume alone (ms)."""
    cur = await conn.execute(
        """SELECT (SELECT ARRAY[extract(epoch FROM min(e.created_at) FILTER (
                                    WHERE e.type = 'run.started') - i.created_at),
                                extract(epoch FROM min(e.created_at) FILTER (
                                    WHERE e.type = 'message') - i.created_at),
                                extract(epoch FROM max(e.created_at) FILTER (
                                    WHERE e.type = 'session.created'
                                      AND e.session_id <> %(root)s) - i.created_at),
                                extract(epoch FROM min(e.created_at) FILTER (
                                    WHERE e.type = 'tool.finished') - i.created_at),
                                extract(epoch FROM min(e.created_at) FILTER (
                                    WHERE e.type = 'run.suspended') - i.created_at)]
                     FROM yuxi.events e
                    WHERE e.tree_id = %(tree)s
                      AND (e.turn_id = %(turn)s OR e.type = 'session.created')) AS phases,
                  (SELECT percentile_cont(ARRAY[0.5, 0.9]) WITHIN GROUP (
                              ORDER BY extract(epoch FROM r.finished_at - r.started_at) * 1000)
                     FROM yuxi.runs r
                    WHERE r.tree_id = %(tree)s AND r.session_id <> %(root)s
                      AND r.status = 'completed') AS child_ms,
                  (SELECT extract(epoch FROM max(e.created_at) FILTER (
                                      WHERE e.session_id = %(root)s)
                                  - max(e.created_at) FILTER (
                                      WHERE e.session_id <> %(root)s)) * 1000
                     FROM yuxi.events e
                    WHERE e.tree_id = %(tree)s AND e.type = 'turn.completed') AS resume_ms,
                  (SELECT array_agg(n ORDER BY n DESC)
                     FROM (SELECT count(*) AS n FROM yuxi.runs
                            WHERE tree_id = %(tree)s GROUP BY claimer) c) AS per_worker
             FROM yuxi.inputs i WHERE i.id = %(input)s""",
        {"tree": root["tree_id"], "turn": receipt["turn_id"], "root": root["id"],
         "input": receipt["input_id"]})
    phases, child, resume, per_worker = await cur.fetchone()
    child = child or [0.0, 0.0]
    # The run's last phase ends at its suspension: the whole first run.
    first = float(phases[-1] or 0) * 1000 if phases else 0.0
    resume = float(resume or 0)
    return (f"root's first run {first:.0f} ms ({first_phases(phases)}), "
            f"a child's run "
            f"+{child[0] - delay_ms:.1f} ms (p90 +{child[1] - delay_ms:.1f}), root's "
            f"resume {resume:.0f} ms, runs per worker "
            f"{'/'.join(map(str, per_worker or []))}"), resume


def first_phases(marks: list[Any] | None) -> str:
    """The root's first run in phases, each from the previous mark (ms):
    its lease (run.started after its input), its create's answer (the
    `message` event, committed with the step and its calls' tool.started),
    the children created (their last session.created, in the create's
    transaction), the results saved (the first tool.finished, with the
    step's checkpoint) and its suspension (the wait's step, its interrupt
    and run.suspended)."""
    names = ("leased", "answer", "children created", "results saved", "suspended")
    if not marks or any(m is None for m in marks):
        return "phases n/a"
    ms = [float(m) * 1000 for m in marks]
    return ", ".join(f"{name} +{b - a:.0f}"
                     for name, a, b in zip(names, [0.0, *ms], ms))


async def chain_cycles(conn: psycopg.AsyncConnection, root: dict[str, Any],
                       receipt: dict[str, Any], delay_ms: int) -> list[tuple[float, list[float]]]:
    """The fan-out's chains: the children that one slot ran one after the
    other, each handed over by its predecessor's completion (leased in that
    transaction: its started_at is the predecessor's finished_at, on the same
    worker). For each chain, oldest first: its start after the root's input
    (ms) and its cycles beyond the model's delay (ms, from one child's lease
    to the next's). The longest chain, with the root's resume, is the
    elapsed time."""
    cur = await conn.execute(
        """SELECT r.started_at, r.finished_at, r.claimer
             FROM yuxi.runs r JOIN yuxi.sessions s ON s.id = r.session_id
            WHERE r.tree_id = %s AND s.parent_id IS NOT NULL AND r.status = 'completed'
            ORDER BY r.started_at""", (root["tree_id"],))
    runs = await cur.fetchall()
    cur = await conn.execute("SELECT created_at FROM yuxi.inputs WHERE id = %s",
                             (receipt["input_id"],))
    (began,) = await cur.fetchone()
    following = {(started, claimer): (started, finished, claimer)
                 for started, finished, claimer in runs}
    handed = {(finished, claimer) for _started, finished, claimer in runs}
    chains = []
    for first in (r for r in runs if (r[0], r[2]) not in handed):
        chain = [first]
        # (A run finishes after it starts: a chain never comes back.)
        while (nxt := following.get((chain[-1][1], chain[-1][2]))) is not None:
            chain.append(nxt)
        chains.append(((first[0] - began).total_seconds() * 1000,
                       [(b[0] - a[0]).total_seconds() * 1000 - delay_ms
                        for a, b in zip(chain, chain[1:])]))
    return sorted(chains)


def mean_cycle(cycles: list[float]) -> float:
    return statistics.mean(cycles) if cycles else float("nan")


async def scenario_chain(args: Any, log_dir: Path) -> list[str]:
    """The fan-out's children on a tree of ONE slot: one chain, each child
    handed over by the previous one's completion, with no other chain to
    meet on the tree's lock or the vCPUs. Its cycle is the least a child's
    slot costs on this machine beyond the model's delay; the 4-slot
    fan-out's chains (their mean cycles on its lines) pay it and their
    contention."""
    lines = []
    cycles: list[float] = []
    async for attempt, conn, root, receipt, _status, machine in fan_outs(
            args, log_dir, args.chain_children, slots=1):
        these = sorted(c for _start, chain in await chain_cycles(conn, root, receipt,
                                                                 args.delay_ms)
                       for c in chain)
        line = (f"chain ({attempt}): {args.chain_children} children x {args.delay_ms} ms "
                f"on 1 slot: cycle beyond the delay mean +{mean_cycle(these):.1f} ms, "
                f"p50 +{pct(these, 0.5):.1f}, p10 +{pct(these, 0.1):.1f}, "
                f"p90 +{pct(these, 0.9):.1f}; {machine}")
        print(line, flush=True)
        lines.append(line)
        if attempt != "warm-up":
            cycles += these
    LONE_CYCLES.extend(cycles)
    if cycles:
        line = (f"chain: {len(cycles)} cycles measured: mean +{mean_cycle(cycles):.1f} ms, "
                f"p50 +{pct(cycles, 0.5):.1f}, "
                f"p10 +{pct(cycles, 0.1):.1f}, p90 +{pct(cycles, 0.9):.1f}")
        print(line, flush=True)
        lines.append(line)
    return lines


# What the fan-out's floor line is made of (fan_out_floor): per measured
# fan-out, its chains (start in ms after the root's input, children) and the
# root's resume (ms); the lone chain's cycles (ms over the delay).
FLOOR_PARTS: list[tuple[list[tuple[float, int]], float]] = []
LONE_CYCLES: list[float] = []


def fan_out_floor(children: int, delay_ms: int,
                  parts: list[tuple[list[tuple[float, int]], float]] = FLOOR_PARTS,
                  lone_cycles: list[float] = LONE_CYCLES) -> str | None:
    """The fan-out as it would take with its chains cycling as one chain
    alone does: the chain that would end last (its start, then its children
    each at the delay plus the lone cycle's mean), then the root's resume;
    the median of the measured fan-outs' floors (the higher middle one of
    an even number). The elapsed time is those three; what the fan-out's
    chains pay beyond the lone cycle is their contention. A machine whose
    floor is over 1.1x cannot meet the target by cutting contention alone.
    `parts` and `lone_cycles`: what the scenarios recorded (FLOOR_PARTS,
    LONE_CYCLES)."""
    if not parts or not lone_cycles:
        return None
    ideal = children * delay_ms / SLOTS
    cycle = mean_cycle(lone_cycles)
    floors = sorted((start + k * (delay_ms + cycle) + resume, start, k, resume)
                    for chains, resume in parts
                    for start, k in [max(chains, key=lambda c: c[0] + c[1] * (delay_ms + cycle))])
    floor, start, k, resume = floors[len(floors) // 2]
    return (f"fan-out floor (its chains at the lone chain's cycle): the chain ending last "
            f"starts +{start:.0f} ms, {k} children x ({delay_ms} + {cycle:.1f}) ms, the "
            f"root's resume {resume:.0f} ms: {floor / 1000:.3f} s, ratio {floor / ideal:.3f} "
            f"(target <= 1.10)")


# --------------------------------------------------------------------------
# 2. Wake


# Waits before the measured ones: each connection of a worker's pools plans
# the PL/pgSQL functions it runs on first use (~1-3 ms a transition on this
# machine), and a worker's pool grows to ~10 connections; steady state is
# warm connections.
WAKE_WARMUP = 20


def wake_script(delay_ms: int) -> dict[str, Any]:
    return {
        "rules": [{"match": "^wake", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "w", "task": "child"}}]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}",
                "timeout_s": 600}}]},
            {"say": "woke"},
        ]}],
        "default": [{"say": "child done", "delay_ms": delay_ms}],
    }


async def scenario_wake(args: Any, log_dir: Path) -> list[str]:
    wakes: list[float] = []
    answers: list[float] = []
    async with services(args.database_url, log_dir, workers=args.workers) as (_base, _key, http):
        async with await psycopg.AsyncConnection.connect(args.database_url,
                                                         autocommit=True) as conn:
            for i in range(args.waits + WAKE_WARMUP):
                root = await new_session(http, wake_script(200), ["cooperation"])
                receipt = await post(http, root["id"], "wake")
                await wait_turn(conn, root["tree_id"], receipt["turn_id"])
                cur = await conn.execute(
                    """WITH child AS (SELECT created_at FROM yuxi.events WHERE tree_id = %(t)s
                                        AND session_id <> %(s)s AND type = 'turn.completed')
                       SELECT extract(epoch FROM
                         (SELECT max(created_at) FROM yuxi.events WHERE tree_id = %(t)s
                            AND session_id = %(s)s AND type = 'run.started')
                         - (SELECT created_at FROM child)),
                              extract(epoch FROM
                         (SELECT created_at FROM yuxi.events WHERE tree_id = %(t)s
                            AND session_id = %(s)s AND type = 'turn.completed')
                         - (SELECT created_at FROM child))""",
                    {"t": root["tree_id"], "s": root["id"]})
                wake, answered = await cur.fetchone()
                if i >= WAKE_WARMUP:
                    wakes.append(float(wake) * 1000)
                    answers.append(float(answered) * 1000)
    # The second figure is the whole resumed run: the wait's result, the
    # model's answer and the completion (the parent's answer to its waiter).
    line = (f"wake: {len(wakes)} waits, child turn.completed -> parent run.started: "
            f"p50 {pct(wakes, 0.5):.1f} ms, p99 {pct(wakes, 0.99):.1f} ms, "
            f"max {max(wakes):.1f} ms, min {min(wakes):.1f} ms (target p99 <= 10 ms); "
            f"-> parent turn.completed p50 {pct(answers, 0.5):.1f} ms, "
            f"p99 {pct(answers, 0.99):.1f} ms")
    print(line, flush=True)
    return [line]


# --------------------------------------------------------------------------
# 3. SSE fan-in


class Subscriber(asyncio.BufferedProtocol):
    """One event stream of the lean client. A buffered protocol: the loop
    reads into one shared 64 KiB buffer, and each arrival keeps a copy of
    its bytes. (A plain `asyncio.Protocol` has the loop allocate 256 KiB
    for every read, most of them an mmap and a munmap: in a bare test, one
    pass's bytes reached 500 such readers at p99 16 ms instead of 8, the
    client's own cost, which it would measure as the server's delay.)"""
    last_data = 0.0  # the last arrival at any subscriber
    buffer = memoryview(bytearray(65536))  # shared: each read is copied out at once

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.chunks: list[tuple[float, bytes]] = []
        self.got_data = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def get_buffer(self, sizehint: int) -> memoryview:
        return Subscriber.buffer

    def buffer_updated(self, nbytes: int) -> None:
        now = time.time()
        self.chunks.append((now, bytes(Subscriber.buffer[:nbytes])))
        Subscriber.last_data = now
        if not self.got_data.done():
            self.got_data.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.got_data.done():
            self.got_data.set_result(None)

    def frames(self) -> tuple[int, list[tuple[int, float]]]:
        """(HTTP status, [(seq, arrival)]) from the bytes as received."""
        raw = bytearray()
        body = bytearray()
        sse = b""
        status = 0
        headers_done = False
        chunked = False
        out: list[tuple[int, float]] = []
        for t, data in self.chunks:
            raw += data
            if not headers_done:
                end = raw.find(b"\r\n\r\n")
                if end < 0:
                    continue
                head = bytes(raw[:end]).decode("latin-1")
                status = int(head.split(" ", 2)[1])
                chunked = "transfer-encoding: chunked" in head.lower()
                del raw[:end + 4]
                headers_done = True
            if chunked:
                while True:
                    nl = raw.find(b"\r\n")
                    if nl < 0:
                        break
                    size = int(bytes(raw[:nl]).split(b";")[0], 16)
                    if len(raw) < nl + 2 + size + 2:
                        break
                    body += raw[nl + 2:nl + 2 + size]
                    del raw[:nl + 2 + size + 2]
            else:
                body += raw
                raw.clear()
            sse += bytes(body).replace(b"\r\n", b"\n")
            body.clear()
            *blocks, sse = sse.split(b"\n\n")
            for block in blocks:
                m = re.search(rb"^id: ?(\d+)", block, re.M)
                if m:
                    out.append((int(m.group(1)), t))
        return status, out


class Listener(threading.Thread):
    """The bench's own LISTEN yuxi_events connection: arrival times."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.times: list[float] = []
        self.ready = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("LISTEN yuxi_events")
            self.ready.set()
            while not self.stop.is_set():
                for _n in conn.notifies(timeout=0.2):
                    self.times.append(time.time())


async def sse_run(args: Any, log_dir: Path, label: str, extra_env: dict[str, str],
                  interval: float) -> str:
    extra_env = {**dict(kv.split("=", 1) for kv in args.api_env), **extra_env}
    if args.sse_trace:
        extra_env = {**extra_env, "YUXI_SSE_TRACE": "1"}
    async with services(args.database_url, log_dir, extra_env) as (base, key, http):
        session = await new_session(http, {"default": [{"say": "ok {{ input }}"}]})
        tree = session["tree_id"]
        port = int(base.rsplit(":", 1)[1])
        request = (f"GET /api/sessions/{session['id']}/events HTTP/1.1\r\n"
                   f"Host: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
                   "Accept: text/event-stream\r\n\r\n").encode()
        async with await psycopg.AsyncConnection.connect(args.database_url,
                                                         autocommit=True) as conn:
            # A warm-up turn before the subscribers.
            r = await post(http, session["id"], "warm")
            await wait_turn(conn, tree, r["turn_id"])
            loop = asyncio.get_running_loop()
            subs: list[Subscriber] = []
            for start in range(0, args.subscribers, 50):
                batch = [Subscriber(request) for _ in range(start, min(start + 50,
                                                                       args.subscribers))]
                await asyncio.gather(*(loop.create_connection(lambda s=s: s, "127.0.0.1", port)
                                       for s in batch))
                subs += batch
            await asyncio.wait_for(asyncio.gather(*(s.got_data for s in subs)), 60)
            await asyncio.sleep(1.0)  # the replays (the warm-up turn's events) arrive
            cur = await conn.execute("SELECT coalesce(max(seq), 0) FROM yuxi.events "
                                     "WHERE tree_id = %s", (tree,))
            (first_seq,) = await cur.fetchone()
            listener = Listener(args.database_url)
            listener.start()
            listener.ready.wait(10)
            # The bench's own collector stays out of the arrival times: the
            # chunks it keeps (60,000 and more) made its full collections
            # pause this loop by tens of milliseconds mid-run.
            gc.collect()
            gc.disable()
            try:
                api_proc = psutil.Process(services.api_pid)
                me = psutil.Process()
                cpu0 = (sum(api_proc.cpu_times()[:2]), sum(me.cpu_times()[:2]))
                began = time.monotonic()
                for k in range(args.turns):
                    t = time.monotonic()
                    r = await post(http, session["id"], f"turn {k}")
                    await wait_turn(conn, tree, r["turn_id"])
                    await asyncio.sleep(max(0.0, interval - (time.monotonic() - t)))
                drive = time.monotonic() - began
                # Until every frame has arrived: no byte at any subscriber for 2 s
                # (keepalives come every 15 s), at most 120 s.
                deadline = time.monotonic() + 120
                while time.time() - Subscriber.last_data < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                drained = time.monotonic() - began - drive
            finally:
                gc.enable()
            api_cpu = sum(api_proc.cpu_times()[:2]) - cpu0[0]
            bench_cpu = sum(me.cpu_times()[:2]) - cpu0[1]
            listener.stop.set()
            cur = await conn.execute(
                "SELECT seq, extract(epoch FROM created_at)::float8 FROM yuxi.events "
                "WHERE tree_id = %s AND seq > %s ORDER BY seq", (tree, first_seq))
            created = dict(await cur.fetchall())
            for s in subs:
                if s.transport:
                    s.transport.close()
        listener.join(5)
    notifies = sorted(listener.times)

    def committed(ts: float) -> float:
        i = bisect.bisect_left(notifies, ts)
        return notifies[i] if i < len(notifies) else float("nan")

    commit_seen = {seq: committed(ts) for seq, ts in created.items()}
    from_insert: list[float] = []
    from_notify: list[float] = []
    received = 0
    bad_status = 0
    for s in subs:
        status, frames = s.frames()
        if status != 200:
            bad_status += 1
        seen = set()
        for seq, t in frames:
            if seq in created and seq not in seen:
                seen.add(seq)
                received += 1
                from_insert.append((t - created[seq]) * 1000)
                if commit_seen[seq] == commit_seen[seq]:
                    from_notify.append((t - commit_seen[seq]) * 1000)
    expected = len(created) * len(subs)
    pacing = f"one every {interval:g} s" if interval else "back to back"
    line = (f"SSE fan-in ({label}, turns {pacing}): {len(subs)} subscribers, {args.turns} "
            f"turns in {drive:.2f} s (+{max(0.0, drained - 2):.1f} s until the last frame), frames received {received} of {expected}"
            f"{f', {bad_status} non-200' if bad_status else ''}; delay from the event's "
            f"insert p50 {pct(from_insert, 0.5):.1f} ms p99 {pct(from_insert, 0.99):.1f} ms "
            f"max {max(from_insert, default=float('nan')):.1f} ms; from the NOTIFY at the "
            f"bench p50 {pct(from_notify, 0.5):.1f} ms p99 {pct(from_notify, 0.99):.1f} ms "
            f"(target p99 <= 20 ms); CPU meanwhile: API {api_cpu:.2f} s "
            f"({api_cpu / max(received, 1) * 1e6:.0f} us a frame), this bench (client, parse "
            f"later) {bench_cpu:.2f} s")
    if args.sse_trace:
        line += _trace_summary(log_dir / "api.log")
    print(line, flush=True)
    return line


def _trace_summary(path: Path) -> str:
    """Where the API's milliseconds went (YUXI_SSE_TRACE=1 lines of
    yuxi.api.feed: one per feed read), and the GC pauses over 2 ms during the
    turns: those logged before the first feed read's line (the process
    starting, the subscribers connecting) delay no frame and are only
    counted. (A feed read is logged after its delivery, so a pause inside
    the very first pass is counted with them.)"""
    text = path.read_text(errors="replace")
    parts: dict[str, list[float]] = {"NOTIFY->feed awake": [], "read": [], "delivery": []}
    # (The awake figure goes negative when the NOTIFY was noted after the
    # feed woke for an earlier one.)
    reads = list(re.finditer(r"NOTIFY->feed awake (-?[\d.]+) ms, read ([\d.]+) ms, "
                             r"delivery ([\d.]+) ms", text))
    for m in reads:
        for name, value in zip(parts, m.groups()):
            parts[name].append(float(value))
    first = reads[0].start() if reads else len(text)
    gcs = list(re.finditer(r"gc generation \d took [\d.]+ ms.*", text))
    during = [m.group(0) for m in gcs if m.start() > first]
    gc_note = (f"; GC pauses over 2 ms during the turns: {len(during)} "
               f"({len(gcs) - len(during)} more before them)"
               + "".join(f"\n      {g}" for g in during))
    return gc_note + f"\n    trace, {len(reads)} feed reads: " + "; ".join(
        f"{name} p50 {pct(v, 0.5):.2f} p99 {pct(v, 0.99):.2f} max {max(v, default=0):.2f} ms"
        for name, v in parts.items())


# The receiving end of write_floor: a process of its own that connects n
# sockets to the port, reads whatever arrives until they close, and then
# prints the wall-clock time of each read (one line, space-separated): the
# arrival of a pass's bytes at a lean client, with nothing of ours between.
_FLOOR_READER = """
import selectors, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
sel = selectors.DefaultSelector()
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
arrived = []
while sel.get_map():
    for key, _ in sel.select():
        if key.fileobj.recv(65536):
            arrived.append(time.time())
        else:
            sel.unregister(key.fileobj)
print(" ".join(f"{t:.6f}" for t in arrived))
"""


FLOOR_BYTES = 400  # about one event's SSE frame


async def write_floor(n: int, rounds: int = 30,
                      size: int = FLOOR_BYTES) -> tuple[float, float, float, float]:
    """The floor of one SSE delivery pass on this machine: a bare asyncio
    loop writing `size` bytes to each of `n` loopback sockets whose reader
    is another process, `rounds` times 50 ms apart (as frames come, with
    the reader idle in between). Returns, in ms, (p50, p90) of a pass and
    (p50, p99) of a read at the reader after its pass began: the least a
    frame's delay from its NOTIFY can be, with one pass and no read. A
    write on loopback does the receiver's TCP work and wakes it: its cost
    is the kernel's, and it varied 2x between days on this machine (7.8 µs
    a write, then 17), so the SSE delays are read against it."""
    loop = asyncio.get_running_loop()
    accepted: asyncio.Queue[asyncio.Transport] = asyncio.Queue()

    class Sink(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            accepted.put_nowait(transport)

    server = await loop.create_server(Sink, "127.0.0.1", 0, backlog=n)
    port = server.sockets[0].getsockname()[1]
    reader = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOOR_READER,
                                                  str(port), str(n),
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        transports = [await asyncio.wait_for(accepted.get(), 30) for _ in range(n)]
        data = b"x" * size
        passes, starts = [], []
        for _ in range(rounds):
            starts.append(time.time())
            began = time.perf_counter()
            for t in transports:
                t.write(data)
            passes.append((time.perf_counter() - began) * 1000)
            await asyncio.sleep(0.05)
        for t in transports:
            t.close()
        out, _ = await asyncio.wait_for(reader.communicate(), 10)
    finally:
        if reader.returncode is None:
            reader.kill()
            await reader.wait()
        server.close()
    # Each read belongs to the last pass that began before it (passes are
    # 50 ms apart, a pass's bytes arrive within a few ms).
    arrivals = [(t - starts[bisect.bisect_right(starts, t) - 1]) * 1000
                for t in map(float, out.split()) if t >= starts[0]]
    return pct(passes, 0.5), pct(passes, 0.9), pct(arrivals, 0.5), pct(arrivals, 0.99)


async def scenario_sse(args: Any, log_dir: Path) -> list[str]:
    p50, p90, a50, a99 = await write_floor(args.subscribers)
    lines = [f"SSE floor (this machine now): a bare asyncio loop writes {FLOOR_BYTES} bytes to each of "
             f"{args.subscribers} loopback sockets in p50 {p50:.1f} ms, p90 {p90:.1f} ms "
             f"({p50 / args.subscribers * 1000:.1f} µs a write): one delivery pass to all "
             f"subscribers cannot take less; its bytes reach a lean reader p50 {a50:.1f} ms, "
             f"p99 {a99:.1f} ms after the pass begins"]
    print(lines[0], flush=True)
    for interval in (0.0, args.interval):
        lines.append(await sse_run(args, log_dir, "default feed", {}, interval))
        if not args.sse_feed_only:
            lines.append(await sse_run(args, log_dir, "YUXI_SSE_FEED_EVENTS=0",
                                       {"YUXI_SSE_FEED_EVENTS": "0"}, interval))
    return lines


# --------------------------------------------------------------------------


class CpuTime:
    """This machine's CPU time (measure.cpu_times) from its making to
    `shares`: how busy its vCPUs were, and how much of the time their host
    gave to others (steal: a VM's vCPU that is ready to run and is not). A
    run whose vCPUs were stolen a quarter of the time is slower for it,
    whatever the code did."""

    def __init__(self) -> None:
        self.began = measure.cpu_times()

    def shares(self) -> str:
        spent = [b - a for a, b in zip(self.began, measure.cpu_times())]
        user, nice, system, _idle, _iowait, irq, softirq, steal = spent
        total = sum(spent) or 1
        busy = user + nice + system + irq + softirq
        return f"vCPUs busy {busy / total:.0%}, stolen {steal / total:.0%}"


def machine_speed() -> float:
    """Seconds a 10-million-step Python loop takes: this machine's speed
    wanders by 2x within an hour, and the figures with it; printed at the
    start and the end so that runs of different hours can be told apart."""
    began = time.perf_counter()
    for _ in range(10_000_000):
        pass
    return time.perf_counter() - began


async def round_trips(url: str, n: int = 200) -> str:
    """`SELECT 1` round trips to the server, back to back and with 5 ms of
    idleness before each: what waking an idle process costs on this machine
    (a VM whose idle vCPUs halt pays it at every wake-up; the runs above
    wait on a model's 200 ms, on a lock or on a client between steps)."""
    # The server's own database: the bench's is created by each scenario.
    conninfo = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        figures = []
        for idle in (0.0, 0.005):
            times = []
            for _ in range(n):
                if idle:
                    await asyncio.sleep(idle)
                began = time.perf_counter()
                await conn.execute("SELECT 1")
                times.append((time.perf_counter() - began) * 1000)
            figures.append(statistics.median(times))
    return (f"a SELECT 1 round trip p50 {figures[0]:.3f} ms back to back, "
            f"{figures[1]:.3f} ms after 5 ms idle")


async def main_async(args: Any) -> None:
    scenarios = {"fanout": scenario_fanout, "chain": scenario_chain, "wake": scenario_wake,
                 "sse": scenario_sse}
    lines: list[str] = []
    speed = [machine_speed()]
    trips = await round_trips(args.database_url)
    with tempfile.TemporaryDirectory(prefix="yuxi-latency-") as tmp:
        async with bench.exclusive(args.database_url):
            for name in args.scenarios.split(","):
                log_dir = Path(tmp) / name
                log_dir.mkdir()
                try:
                    lines += await scenarios[name](args, log_dir)
                except Exception as exc:  # a report: say what failed, go on
                    line = f"{name}: FAILED: {exc!r}"
                    for log in sorted(log_dir.glob("*.log")):
                        line += f"\n--- {log.name}\n" + "\n".join(
                            log.read_text(errors="replace").splitlines()[-15:])
                    print(line, flush=True)
                    lines.append(line)
    if (line := fan_out_floor(args.children, args.delay_ms)) is not None:
        print(line, flush=True)
        lines.append(line)
    speed.append(machine_speed())
    print("\nlatency summary:")
    for line in lines:
        print("  " + line.splitlines()[0])
    print(f"  machine: a 10-million-step Python loop took {speed[0]:.2f} s at the start, "
          f"{speed[1]:.2f} s at the end; {trips}")


def main(argv: list[str] | None = None) -> int:
    from yuxi import db

    p = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="fanout,chain,wake,sse")
    p.add_argument("--children", type=int, default=64)
    p.add_argument("--chain-children", type=int, default=24,
                   help="children of the one-slot fan-out (the chain scenario)")
    p.add_argument("--fanouts", type=int, default=3,
                   help="measured fan-outs after the warm-up one (default 3)")
    p.add_argument("--workers", type=int, default=2,
                   help="worker processes for the fan-out and wake scenarios (default 2)")
    p.add_argument("--delay-ms", type=int, default=200)
    p.add_argument("--waits", type=int, default=50)
    p.add_argument("--subscribers", type=int, default=500)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--interval", type=float, default=1.0,
                   help="the SSE scenario's paced run starts a turn every INTERVAL s")
    p.add_argument("--sse-feed-only", action="store_true",
                   help="skip the SSE runs with YUXI_SSE_FEED_EVENTS=0")
    p.add_argument("--profile", metavar="DIR", type=Path, default=None,
                   help="cProfile (CPU time) the API and workers into DIR, as benchmarks.run "
                        "does (numbers of a profiled run are not comparable)")
    p.add_argument("--api-env", action="append", default=[], metavar="YUXI_X=V",
                   help="an environment variable for the API and workers of the SSE runs "
                        "(repeatable), e.g. YUXI_SSE_BUFFER_EVENTS=100")
    p.add_argument("--sse-trace", action="store_true",
                   help="the API logs, per feed read, NOTIFY->feed awake, read and delivery "
                        "times (YUXI_SSE_TRACE=1); summarized after each SSE run")
    p.add_argument("--database-url", default=db.with_database(
        os.environ.get("YUXI_BENCH_DATABASE_URL", bench.DEFAULT_URL), DEFAULT_DB))
    args = p.parse_args(argv)
    services.profile_dir = args.profile
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
