"""The `yuxi` command: database setup, keys and agents, the API, the worker,
and `yuxi dev` (everything at once, what `make run` calls).

Heavy modules (LangGraph via yuxi.schema, the services) are imported by the
commands that need them, so `yuxi --help` and argument errors stay fast.

Operator mistakes (a wrong URL, a server that is down, a schema of another
version) end as one `yuxi: error: ...` line and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from yuxi import db, pgserver
from yuxi.errors import SchemaVersionMismatch, YuxiError
from yuxi.settings import Settings

API_FACTORY = "yuxi.api.app:create_app"
WORKER_APP = "workers.app.app"
DEFAULT_DATA_DIR = Path(".yuxi") / "pgdata"


# --------------------------------------------------------------------------
# Commands


def cmd_db_init(args: argparse.Namespace, settings: Settings) -> int:
    from yuxi import schema

    async def init() -> str:
        await pgserver.check_server_async(settings.database_url)
        await schema.ensure_database(settings.database_url)
        return await schema.apply_schema(settings.database_url)

    outcome = asyncio.run(init())
    print("schema created" if outcome == "created" else "schema up to date")
    return 0


def cmd_keys_create(args: argparse.Namespace, settings: Settings) -> int:
    from yuxi.services import accounts

    async def create() -> str:
        async with _schema_pool(settings.database_url) as pool:
            key, _ = await accounts.create_key(pool, args.user, args.app)
            return key

    # Only the key on stdout, so `KEY=$(yuxi keys create ...)` works.
    print(asyncio.run(create()))
    return 0


def cmd_agents_create(args: argparse.Namespace, settings: Settings) -> int:
    from yuxi.services import accounts

    async def create() -> str:
        async with _schema_pool(settings.database_url) as pool:
            scope = await accounts.ensure_scope(pool, args.user, args.app)
            agent = await accounts.create_agent(
                pool, scope, args.name, args.config, replace=args.replace
            )
            return str(agent.id)

    print(asyncio.run(create()))
    return 0


def cmd_grants(args: argparse.Namespace, settings: Settings) -> int:
    """Create the resource if needed and grant it, or revoke a live grant."""
    from yuxi.services import accounts, resources

    async def change() -> str:
        async with _schema_pool(settings.database_url) as pool:
            scope = await accounts.ensure_scope(pool, args.user, args.app)
            if args.grants_command == "add":
                await resources.create(pool, scope.app_id, args.resource)
                await resources.grant(pool, scope, args.resource)
                return f"granted {args.resource} to {args.user} in {args.app}"
            if not await resources.revoke(pool, scope, args.resource):
                raise YuxiError(f"{args.user} holds no live grant of {args.resource} in {args.app}")
            return f"revoked {args.resource} from {args.user} in {args.app}"

    print(asyncio.run(change()))
    return 0


def cmd_events_prune(args: argparse.Namespace, settings: Settings) -> int:
    from yuxi.services import retention

    async def prune() -> tuple[int, int]:
        async with _schema_pool(settings.database_url) as pool:
            return await retention.prune_events(pool, args.before)

    trees, deleted = asyncio.run(prune())
    print(f"deleted {deleted} events created before {args.before.isoformat()} "
          f"in {trees} trees")
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    # Fail fast with one line rather than with the app's startup traceback.
    pgserver.check_server(settings.database_url)
    uvicorn.run(API_FACTORY, factory=True, host=args.host or settings.host,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
                port=args.port or settings.port, log_level="info")
    return 0


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Supervise one worker process (`python -m workers.run`): a worker that
    crashes is started again with backoff, and the console says so."""
    pgserver.check_server(settings.database_url)
    return supervise({"worker": worker_command(args.extra)}, dict(os.environ))


def cmd_dev(args: argparse.Namespace, settings: Settings) -> int:
    return run_dev(settings, Path(args.data_dir))


# --------------------------------------------------------------------------
# Helpers


def worker_command(extra: list[str]) -> list[str]:
    """One worker process (workers/run.py: Procrastinate's worker, started
    again in-process when the database went away) with this interpreter, so
    the worker sees the same environment whatever is on PATH."""
    return [sys.executable, "-m", "workers.run", *extra]


# On SIGTERM uvicorn waits for open connections before shutting down; SSE
# streams never end by themselves, so they get this long (clients resume with
# Last-Event-ID, on this process or another).
GRACEFUL_SHUTDOWN_SECONDS = 1


def api_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", API_FACTORY,
            "--host", host, "--port", str(port),
            "--timeout-graceful-shutdown", str(GRACEFUL_SHUTDOWN_SECONDS)]


class _schema_pool:
    """A small pool on a database that has our schema; a missing or foreign
    schema is an operator error with a clear next step, not an SQL error."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = db.app_pool(url, min_size=1, max_size=2)

    async def __aenter__(self):
        from yuxi import schema

        await pgserver.check_server_async(self.url)
        async with await psycopg.AsyncConnection.connect(self.url, connect_timeout=5) as conn:
            version = await schema.installed_version(conn)
        if version is None:
            raise YuxiError("the database has no yuxi schema: run `yuxi db init` first")
        if version != schema.SCHEMA_VERSION:
            raise SchemaVersionMismatch(
                f"the database has yuxi schema version {version}, "
                f"this code needs version {schema.SCHEMA_VERSION}"
            )
        await self.pool.open(wait=True, timeout=10)
        return self.pool

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.close()


def _json_config(value: str) -> dict[str, Any]:
    """`--config`: inline JSON, or @path to a JSON file."""
    try:
        text = Path(value[1:]).read_text() if value.startswith("@") else value
        config = json.loads(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON or an @file of JSON: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("the agent config must be a JSON object")
    return config


def _time_before(value: str) -> dt.datetime:
    """`--before`: an ISO 8601 time (UTC unless it says otherwise) or an age
    such as 30d, 12h, 45m."""
    if match := re.fullmatch(r"(\d+)([dhm])", value.strip()):
        unit = {"d": "days", "h": "hours", "m": "minutes"}[match[2]]
        return dt.datetime.now(dt.UTC) - dt.timedelta(**{unit: int(match[1])})
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither an ISO 8601 time nor an age like 30d, 12h or 45m") from None
    return at if at.tzinfo else at.replace(tzinfo=dt.UTC)


def one_line(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


# --------------------------------------------------------------------------
# yuxi dev: one command from a clone to a running system

# The demo agent is an orchestrator: it creates a writer and a reviewer child,
# waits for both without holding a slot, and composes their exact results.
# Children inherit this config; their tasks match the writer/reviewer rules.
DEMO_AGENT: dict[str, Any] = {
    "model": "replay",
    "tools": ["echo", "cooperation"],
    "replay": {
        "rules": [
            {"match": "(?i)^hello", "steps": [
                {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}]},
                {"say": "echo said: {{ last.text }}"},
            ]},
            {"match": "^Write a draft about: ", "steps": [
                {"say": "Draft ({{ session.path }}): {{ input[21:] }} - stored durably, "
                        "replayed exactly, never lost.", "delay_ms": 400},
            ]},
            {"match": "^Review this topic: ", "steps": [
                {"say": "Review ({{ session.path }}): clear and short; keep it.",
                 "delay_ms": 400},
            ]},
        ],
        "default": [
            {"call": [
                {"tool": "create_session", "args": {
                    "name": "writer", "title": "Writer",
                    "task": "Write a draft about: {{ input }}"}},
                {"tool": "create_session", "args": {
                    "name": "reviewer", "title": "Reviewer",
                    "task": "Review this topic: {{ input }}"}},
            ]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}",
                "timeout_s": 120}}]},
            {"call": [
                {"tool": "get_result", "args": {"input_id": "{{ results[0].input_id }}"}},
                {"tool": "get_result", "args": {"input_id": "{{ results[1].input_id }}"}},
            ]},
            {"say": "{{ results[3].output.text }}\n{{ results[4].output.text }}"},
        ],
    },
}

STOP_GRACE_SECONDS = 10.0


def run_dev(settings: Settings, data_dir: Path) -> int:
    if _listening(settings.host, settings.port):
        raise YuxiError(f"{settings.host}:{settings.port} is already in use; "
                        "set YUXI_PORT to another port")
    url, server, key, agent_id = asyncio.run(_prepare_dev(settings, data_dir))
    try:
        return _supervise(settings, url, server is not None, key, agent_id)
    finally:
        pgserver.stop_server(server)


async def _prepare_dev(settings: Settings, data_dir: Path):
    from yuxi import schema
    from yuxi.services import accounts

    url, server = await pgserver.ensure_server(settings, data_dir)
    try:
        await schema.ensure_database(url)
        await schema.apply_schema(url)
        async with _schema_pool(url) as pool:
            # A new key every run: keys are stored hashed, an old one cannot be shown.
            key, scope = await accounts.create_key(pool, "demo", "demo")
            agent = await accounts.create_agent(pool, scope, "demo", DEMO_AGENT, replace=True)
    except BaseException:
        pgserver.stop_server(server)
        raise
    return url, server, key, agent.id


# A crashed child is started again after RESTART_BACKOFF_FIRST seconds,
# doubling up to RESTART_BACKOFF_MAX; a child that ran RESTART_STABLE_SECONDS
# starts from the first delay again. A child that exits with an error (a
# status > 0, not a signal) GIVE_UP_AFTER times in a row, each time within
# RESTART_STABLE_SECONDS, has a fatal problem: the supervisor stops, exit 1.
RESTART_BACKOFF_FIRST = 1.0
RESTART_BACKOFF_MAX = 30.0
RESTART_STABLE_SECONDS = 60.0
GIVE_UP_AFTER = 5


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.popen: subprocess.Popen | None = None
        self.started = 0.0
        self.restart_at: float | None = None
        self.backoff = RESTART_BACKOFF_FIRST
        self.quick_failures = 0

    def start(self) -> None:
        # Its own session: a terminal Ctrl-C reaches only the supervisor,
        # and each child gets exactly one SIGTERM (a second signal makes it
        # abort its work).
        self.popen = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        self.started = time.monotonic()
        self.restart_at = None

    def check(self) -> bool:
        """Restart the child when due; False when it keeps failing (give up)."""
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                print(f"yuxi: starting the {self.name} process again", file=sys.stderr,
                      flush=True)
                self.start()
            return True
        assert self.popen is not None
        code = self.popen.poll()
        if code is None:
            return True
        ran = now - self.started
        if ran >= RESTART_STABLE_SECONDS:
            self.backoff, self.quick_failures = RESTART_BACKOFF_FIRST, 0
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if code > 0 and ran < RESTART_STABLE_SECONDS:
            self.quick_failures += 1
            if self.quick_failures >= GIVE_UP_AFTER:
                print(f"yuxi: error: the {self.name} process {how} {self.quick_failures} "
                      "times in a row; giving up", file=sys.stderr, flush=True)
                return False
        print(f"yuxi: the {self.name} process {how}; restarting it in {self.backoff:.0f} s",
              file=sys.stderr, flush=True)
        self.restart_at = now + self.backoff
        self.backoff = min(self.backoff * 2, RESTART_BACKOFF_MAX)
        return True


def supervise(commands: dict[str, list[str]], env: dict[str, str],
              on_tick=None) -> int:
    """Run each command as a child until SIGINT/SIGTERM (exit 0); a child
    that dies is restarted with backoff (said on the console); a child that
    keeps failing fatally stops everything (exit 1). `on_tick()` runs every
    0.2 s (the dev banner)."""
    stop_signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop_signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    children = [_Child(name, argv, env) for name, argv in commands.items()]
    try:
        for child in children:
            child.start()
        while not stop_signals:
            for child in children:
                if not child.check():
                    return 1
            if on_tick is not None:
                on_tick()
            time.sleep(0.2)
        print("yuxi: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        _terminate([c.popen for c in children if c.popen is not None])
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(settings: Settings, url: str, embedded: bool, key: str, agent_id) -> int:
    """Run the API and one worker until a signal (exit 0); either one that
    dies is restarted with backoff."""
    env = {**os.environ, "YUXI_DATABASE_URL": url}
    banner_after = time.monotonic() + 30
    banner_shown = False

    def banner() -> None:
        nonlocal banner_shown
        # Shown once the API listens, so it is not buried in startup logs.
        if not banner_shown and (_listening(settings.host, settings.port)
                                 or time.monotonic() > banner_after):
            print(_banner(settings, url, embedded, key, agent_id), flush=True)
            banner_shown = True

    return supervise({"API": api_command(settings.host, settings.port),
                      "worker": worker_command([])}, env, on_tick=banner)


def _terminate(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((_client_host(host), port), timeout=0.5).close()
    except OSError:
        return False
    return True


def _display_url(url: str) -> str:
    """The database URL without its password."""
    return re.sub(r"(://[^:/@]*:)[^@/]+@", r"\1***@", url)


def _banner(settings: Settings, url: str, embedded: bool, key: str, agent_id) -> str:
    base = f"http://{_client_host(settings.host)}:{settings.port}"
    auth = '-H "Authorization: Bearer $KEY"'
    json_type = "-H 'Content-Type: application/json'"
    field = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"{}\"])'"
    where = " (embedded server)" if embedded else ""
    return f"""
Yuxi sessions is running (Ctrl-C stops it).
  web UI    {base}/   (open it in a browser; sign in with the API key below)
  API       {base}
  database  {_display_url(url)}{where}
  API key   {key}
  agent     demo {agent_id}

Try it:
  export YUXI={base} KEY={key} AGENT={agent_id}
  SID=$(curl -s -X POST "$YUXI/api/sessions" {auth} {json_type} \\
        -d "{{\\"agent_id\\": \\"$AGENT\\"}}" | {field.format("id")})
  TURN=$(curl -s -X POST "$YUXI/api/sessions/$SID/inputs" {auth} {json_type} \\
        -d '{{"content": "durable agent sessions"}}' | {field.format("turn_id")})
  curl -sN "$YUXI/api/sessions/$SID/events?scope=tree" {auth}   # SSE; Ctrl-C to stop
  curl -s "$YUXI/api/turns/$TURN/result" {auth}        # the writer's and reviewer's results
  curl -s "$YUXI/api/sessions/$SID/tree" {auth}        # /root, /root/writer, /root/reviewer
"""


# --------------------------------------------------------------------------
# Parser and entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yuxi",
        description="Yuxi sessions: durable LLM agent sessions on PostgreSQL. "
        "The database is YUXI_DATABASE_URL (default "
        "postgresql://postgres@127.0.0.1:5432/yuxi).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    db_parser = commands.add_parser("db", help="database setup")
    db_commands = db_parser.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    db_commands.add_parser(
        "init", help="create the database if missing and install the schema"
    ).set_defaults(func=cmd_db_init)

    keys = commands.add_parser("keys", help="API keys")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create_key = keys_commands.add_parser(
        "create", help="create a key (and its user and app if needed); prints only the key"
    )
    create_key.add_argument("--user", required=True)
    create_key.add_argument("--app", required=True)
    create_key.set_defaults(func=cmd_keys_create)

    agents = commands.add_parser("agents", help="agents")
    agents_commands = agents.add_subparsers(dest="agents_command", required=True,
                                            metavar="COMMAND")
    create_agent = agents_commands.add_parser("create", help="create an agent; prints its id")
    create_agent.add_argument("--user", required=True)
    create_agent.add_argument("--app", required=True)
    create_agent.add_argument("--name", required=True)
    create_agent.add_argument("--config", required=True, type=_json_config,
                              help="agent config as JSON, or @FILE")
    create_agent.add_argument("--replace", action="store_true",
                              help="replace the config of an existing agent of that name")
    create_agent.set_defaults(func=cmd_agents_create)

    grants = commands.add_parser("grants", help="grants of resources (collections, tool groups)")
    grants_commands = grants.add_subparsers(dest="grants_command", required=True,
                                            metavar="COMMAND")
    for name, text in (("add", "grant a resource to a user (creates the resource)"),
                       ("revoke", "revoke a user's grant of a resource")):
        grant = grants_commands.add_parser(name, help=text)
        grant.add_argument("--user", required=True)
        grant.add_argument("--app", required=True)
        grant.add_argument("--resource", required=True,
                           help="collection:<name> or tool_group:<name>")
        grant.set_defaults(func=cmd_grants)

    events = commands.add_parser("events", help="the event log")
    events_commands = events.add_subparsers(dest="events_command", required=True,
                                            metavar="COMMAND")
    prune = events_commands.add_parser(
        "prune", help="delete events created before a time (keeps what replays of live trees, "
        "waits and numbering need; docs/operator-guide.md)")
    prune.add_argument("--before", required=True, type=_time_before,
                       help="ISO 8601 time, or an age such as 30d, 12h, 45m")
    prune.set_defaults(func=cmd_events_prune)

    serve = commands.add_parser("serve", help="run the HTTP API (uvicorn)")
    serve.add_argument("--host", help="default: YUXI_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, help="default: YUXI_PORT or 8000")
    serve.set_defaults(func=cmd_serve)

    commands.add_parser(
        "worker", help="run a worker process (Procrastinate) and restart it with backoff "
        "if it crashes; --concurrency N overrides YUXI_WORKER_CONCURRENCY",
    ).set_defaults(func=cmd_worker, passes_extra=True)

    dev = commands.add_parser(
        "dev", help="set everything up and run the API and a worker (embedded PostgreSQL "
        "if YUXI_DATABASE_URL is unset and nothing answers on the default)",
    )
    dev.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR),
                     help="embedded PostgreSQL data directory (default: %(default)s)")
    dev.set_defaults(func=cmd_dev)

    from yuxi import terminal  # chat, tail, tree: clients of the HTTP API

    terminal.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        settings = Settings.from_env()
        return args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    except (YuxiError, psycopg.Error, OSError) as exc:
        print(f"yuxi: error: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
