"""The terminal client: `yuxi chat`, `yuxi tail`, `yuxi tree`.

It talks to the HTTP API only (yuxi.client), never to the database:
`YUXI_URL` / `--url` and `YUXI_KEY` / `--key`. `--json` prints machine
output (one JSON document, or one JSON line per event).

Exit codes: 0 done, 1 the API refused the request, 2 usage (argparse, a
missing key), 3 the key was refused (401), 4 no such session or agent in
your scope (404), 5 the API did not answer, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import uuid
from typing import Any, TextIO

import msgspec

from yuxi.client import ApiError, AsyncClient, ClientError, Delta, Event, Tree, Unreachable

DEFAULT_URL = "http://127.0.0.1:8000"

EXIT_API, EXIT_USAGE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_UNREACHABLE = 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130


class Usage(Exception):
    """A mistake in the command line or the configuration (exit 2)."""


def _session_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a session id (a UUID): {value!r}") from None


# --------------------------------------------------------------------------
# Rendering


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return ""


def describe(event: Event) -> str | None:
    """One human line for an event (None: not worth a line)."""
    d = event.data
    match event.type:
        case "message":
            text = _text(d.get("content"))
            return f"assistant: {text}" if text.strip() else None
        case "tool.started":
            return f"  -> {d.get('tool')}({_short(d.get('args', {}), 120)})"
        case "tool.finished":
            return f"  <- {d.get('tool')}: {_short(d.get('result', ''))}"
        case "turn.started":
            return "· turn started"
        case "turn.completed":
            return "· turn completed"
        case "turn.failed":
            return f"! turn failed: {d.get('error')}"
        case "turn.cancelled":
            return "· turn cancelled"
        case "turn.cancel_requested":
            return "· cancelling the turn"
        case "turn.waiting":
            return "· waiting for other sessions"
        case "turn.resumed":
            return f"· resumed ({d.get('reason')})"
        case "input.delivered":
            return "· steer delivered"
        case "queue.paused":
            return f"· queue paused ({d.get('reason')}); /continue resumes it"
        case "queue.continued":
            return "· queue continued"
        case "tree.stopped":
            return f"· tree stopped ({d.get('turns')} turns)"
        case "session.created":
            return f"· session {d.get('path')} created"
        case "run.failed":
            return f"! run failed: {d.get('error')}"
    return None


def status_line(tree: Tree) -> str:
    """members running, waiting or queued, and slots used."""
    running = sum(1 for m in tree.sessions if m.status == "running")
    waiting = sum(1 for m in tree.sessions if m.status in ("waiting", "waiting_user"))
    queued = sum(int(m.queue.get("length", 0)) for m in tree.sessions)
    line = (f"[{len(tree.sessions)} members: {running} running, {waiting} waiting, "
            f"{queued} queued")
    if tree.slots is not None:
        line += f" | slots {tree.slots.held}/{tree.slots.capacity}"
        if tree.slots.waiting:
            line += f", {tree.slots.waiting} waiting for one"
    return line + "]"


class Screen:
    """Lines above a status line that is redrawn in place on a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.status = ""
        self.partial = False  # a streamed message is being written

    def _clear(self) -> None:
        if self.tty and self.status:
            self.out.write("\r\x1b[2K")

    def _redraw(self) -> None:
        if self.tty and self.status:
            self.out.write(self.status)
        self.out.flush()

    def line(self, text: str) -> None:
        self._clear()
        if self.partial:
            self.out.write("\n")
            self.partial = False
        self.out.write(text + "\n")
        self._redraw()

    def stream(self, text: str) -> None:
        """Text of a message still being written (message.delta)."""
        self._clear()
        if not self.partial:
            self.out.write("assistant: ")
            self.partial = True
        self.out.write(text)
        self.out.flush()

    def set_status(self, text: str) -> None:
        if text == self.status:
            return
        if self.tty:
            self._clear()
            self.status = text
            self._redraw()
        else:
            self.status = text
            self.out.write(text + "\n")
            self.out.flush()


# --------------------------------------------------------------------------
# Commands


def _client(args: argparse.Namespace) -> AsyncClient:
    key = args.key or os.environ.get("YUXI_KEY")
    if not key:
        raise Usage("no API key: set YUXI_KEY or pass --key")
    return AsyncClient(args.url or os.environ.get("YUXI_URL") or DEFAULT_URL, key)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


async def _tree(args: argparse.Namespace) -> int:
    async with _client(args) as api:
        tree = await api.tree(args.session)
    if args.json:
        print(_json(tree))
        return 0
    for m in tree.sessions:
        depth = m.path.count("/") - 1
        queue = ""
        if m.queue.get("length") or m.queue.get("paused"):
            queue = f"  queue {m.queue.get('length', 0)}" + (" paused" if m.queue.get("paused")
                                                             else "")
        title = f"  {m.title}" if m.title else ""
        print(f"{'  ' * depth}{m.path:<24} {m.status:<12}{queue}{title}  {m.id}")
    print(status_line(tree))
    return 0


async def _tail(args: argparse.Namespace) -> int:
    scope = "tree" if args.tree else "session"
    screen = Screen(sys.stdout)
    async with _client(args) as api:
        session = await api.get_session(args.session)
        refresh = asyncio.Event()

        async def keep_status() -> None:
            while True:
                screen.set_status(status_line(await api.tree(session.id)))
                refresh.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(refresh.wait(), timeout=2.0)
                await asyncio.sleep(0.05)  # one refresh for a burst of events

        status = None if args.json else asyncio.create_task(keep_status())
        try:
            async for item in api.events(session.id, scope=scope, after=args.after):
                if args.json:
                    print(_json(item), flush=True)
                    continue
                if isinstance(item, Delta):
                    screen.stream(item.text)
                    continue
                if (line := describe(item)) is not None:
                    who = "" if scope == "session" else f"{await _path(api, item.session_id)} "
                    screen.line(f"#{item.seq} {who}{line}")
                refresh.set()
                if status is not None and status.done():
                    status.result()  # re-raise what ended it
        finally:
            if status is not None:
                status.cancel()
    return 0


_paths: dict[uuid.UUID, str] = {}


async def _path(api: AsyncClient, session_id: uuid.UUID) -> str:
    if session_id not in _paths:
        _paths[session_id] = (await api.get_session(session_id)).path
    return _paths[session_id]


HELP = ("Enter sends (a steer while a turn runs); /queue TEXT queues instead; "
        "/tree; /stop stops the tree; /continue resumes the queue; /quit; "
        "Ctrl-C cancels the running turn, a second Ctrl-C exits.")


class Chat:
    """One chat session: events in, lines of stdin out, Ctrl-C to cancel."""

    def __init__(self, api: AsyncClient, session_id: uuid.UUID, screen: Screen,
                 json_out: bool) -> None:
        self.api, self.session_id, self.screen, self.json_out = api, session_id, screen, json_out
        self.turn: uuid.UUID | None = None  # the turn in flight
        self.interrupts = 0
        self.done = asyncio.Event()
        self.exit_code = 0
        self.buffer = b""
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self.asking: asyncio.Future | None = None
        self.tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None
        self.cancelling: asyncio.Task | None = None  # a cancel request on its way

    def say(self, text: str) -> None:
        if not self.json_out:
            self.screen.line(text)

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            if isinstance(exc, ApiError) and exc.status not in (401, 404):
                self.say(f"! {exc.message} ({exc.code})")
            else:
                self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()

    # stdin ------------------------------------------------------------------

    def on_stdin(self) -> None:
        chunk = os.read(sys.stdin.fileno(), 65536)
        if not chunk:  # end of input (Ctrl-D)
            self.lines.put_nowait(None)
            return
        self.buffer += chunk
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.lines.put_nowait(line.decode(errors="replace").rstrip("\r"))

    async def read_lines(self) -> None:
        while (line := await self.lines.get()) is not None:
            if self.asking is not None and not self.asking.done():
                self.asking.set_result(line)
                continue
            await self.command(line)
        self.done.set()

    async def ask(self, prompt: str) -> str:
        self.say(prompt)
        self.asking = asyncio.get_running_loop().create_future()
        try:
            return (await self.asking).strip()
        finally:
            self.asking = None

    async def command(self, line: str) -> None:
        text = line.strip()
        if not text:
            return
        if text in ("/quit", "/exit"):
            self.done.set()
        elif text == "/help":
            self.say(HELP)
        elif text == "/tree":
            tree = await self.api.tree(self.session_id)
            for m in tree.sessions:
                self.say(f"{'  ' * (m.path.count('/') - 1)}{m.path} {m.status}")
            self.say(status_line(tree))
        elif text == "/stop":
            stopped = await self.api.stop(self.session_id)
            self.say(f"· stop: {stopped.get('turns', 0)} turns cancelled, queues paused")
        elif text == "/continue":
            await self.api.continue_queue(self.session_id)
            self.say("· queue continued")
        elif text.startswith("/queue"):
            content = text[len("/queue"):].strip()
            if not content:
                self.say("usage: /queue TEXT")
                return
            receipt = await self.api.send_input(self.session_id, content, mode="queue")
            self.say(f"· queued (position {receipt.position})" if receipt.position
                     else "· started")
            self._track(receipt.turn_id, receipt.status)
        elif text.startswith("/"):
            self.say(f"unknown command {text.split()[0]}; /help lists them")
        else:
            steer = self.turn is not None
            receipt = await self.api.send_input(self.session_id, text, mode="steer")
            if steer:
                self.say("· steer sent")
            self._track(receipt.turn_id, receipt.status)

    def _track(self, turn_id: uuid.UUID | None, status: str) -> None:
        if turn_id is not None and status == "started" and self.turn is None:
            self.turn = turn_id
            self.interrupts = 0

    # Ctrl-C -----------------------------------------------------------------

    def on_interrupt(self) -> None:
        self.interrupts += 1
        if self.turn is not None and self.interrupts == 1:
            self.say("· cancelling the running turn (Ctrl-C again exits)")
            self.cancelling = asyncio.create_task(self.api.cancel_turn(self.turn))
            self.cancelling.add_done_callback(self._finished)
            return
        self.exit_code = EXIT_INTERRUPTED
        self.done.set()

    # events -----------------------------------------------------------------

    async def follow(self, after: int | None) -> None:
        async for item in self.api.events(self.session_id, after=after):
            if self.json_out:
                print(_json(item), flush=True)
            if isinstance(item, Delta):
                if not self.json_out:
                    self.screen.stream(item.text)
                continue
            self.on_event(item)

    def on_event(self, event: Event) -> None:
        if event.type == "turn.started" or (event.type == "run.started" and self.turn is None):
            self.turn, self.interrupts = event.turn_id, 0
        elif event.type in ("turn.completed", "turn.failed", "turn.cancelled"):
            if event.turn_id == self.turn:
                self.turn = None
        if event.type == "message" and self.screen.partial:
            # Its text was streamed already: end the line.
            self.screen.partial = False
            if not self.json_out:
                self.screen.out.write("\n")
        elif (line := describe(event)) is not None:
            self.say(line)
        if event.type == "turn.waiting_user":
            self.spawn(self.answer(event.turn_id, event.data.get("pending") or {}))

    async def answer(self, turn_id: uuid.UUID, pending: dict[str, Any]) -> None:
        # A replayed (old) event: ask only what the turn still waits for.
        turn = await self.api.get_turn(turn_id)
        if turn.status != "waiting_user":
            return
        pending = turn.pending or pending
        if pending.get("kind") == "approval":
            decisions = []
            for item in pending.get("approvals", []):
                reply = await self.ask(f"? approve {item.get('tool')}"
                                       f"({_short(item.get('args', {}), 120)})? [y/n]")
                decisions.append({"call_id": item["call_id"],
                                  "approve": reply.lower() in ("y", "yes")})
            await self.api.answer_turn(turn_id, decisions=decisions)
        elif pending.get("kind") == "questions":
            answers: dict[str, Any] = {}
            for q in pending.get("questions", []):
                options = q.get("options") or []
                hint = f" [{' / '.join(options)}]" if options else ""
                if q.get("multi_select"):
                    hint += " (comma-separated)"
                reply = await self.ask(f"? {q.get('question')}{hint}")
                if q.get("multi_select"):
                    answers[q["id"]] = [v.strip() for v in reply.split(",") if v.strip()]
                else:
                    answers[q["id"]] = reply
            await self.api.answer_turn(turn_id, answers=answers)
        self.say("· answered")


async def _resolve_chat_session(api: AsyncClient, args: argparse.Namespace):
    if args.session:
        return await api.get_session(args.session)
    agents = await api.list_agents()
    if args.agent:
        chosen = [a for a in agents if a.name == args.agent]
        if not chosen:
            raise ApiError(404, "not_found", f"no agent named {args.agent!r} in your scope")
    else:
        chosen = agents
        if len(agents) != 1:
            names = ", ".join(sorted(a.name for a in agents)) or "none"
            raise Usage(f"name an agent with --agent NAME (agents: {names}) "
                        "or a session with --session ID")
    return await api.create_session(chosen[0].id)


async def _chat(args: argparse.Namespace) -> int:
    screen = Screen(sys.stdout)
    async with _client(args) as api:
        session = await _resolve_chat_session(api, args)
        chat = Chat(api, session.id, screen, args.json)
        chat.turn = session.current_turn_id
        if not args.json:
            screen.line(f"session {session.id} ({session.path}); /help for commands")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, chat.on_interrupt)
        loop.add_reader(sys.stdin.fileno(), chat.on_stdin)
        chat.spawn(chat.follow(None))
        chat.spawn(chat.read_lines())
        try:
            await chat.done.wait()
            if chat.cancelling is not None:  # exiting must not drop the cancel request
                await asyncio.wait([chat.cancelling], timeout=10)
        finally:
            loop.remove_reader(sys.stdin.fileno())
            loop.remove_signal_handler(signal.SIGINT)
            for task in list(chat.tasks):
                task.cancel()
        if chat.error is not None:
            raise chat.error
        return chat.exit_code


# --------------------------------------------------------------------------
# Entry points (registered by yuxi.cli)


def _run(command) -> Any:
    def run(args: argparse.Namespace, _settings: Any = None) -> int:
        try:
            return asyncio.run(command(args))
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except Usage as exc:
            print(f"yuxi: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ApiError as exc:
            if exc.status == 401:
                print(f"yuxi: error: the API refused the key ({exc.message}); "
                      "check YUXI_KEY or --key", file=sys.stderr)
                return EXIT_AUTH
            if exc.status == 404:
                what = f"session {args.session}" if getattr(args, "session", None) else "it"
                print(f"yuxi: error: {what} not found in your scope ({exc.message})",
                      file=sys.stderr)
                return EXIT_NOT_FOUND
            print(f"yuxi: error: {exc.message} ({exc.code}, HTTP {exc.status})",
                  file=sys.stderr)
            return EXIT_API
        except Unreachable as exc:
            print(f"yuxi: error: {exc}; check YUXI_URL or --url", file=sys.stderr)
            return EXIT_UNREACHABLE
        except ClientError as exc:
            print(f"yuxi: error: {exc}", file=sys.stderr)
            return EXIT_API
    return run


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register chat, tail and tree on the `yuxi` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"the API (default: YUXI_URL or {DEFAULT_URL})")
    common.add_argument("--key", help="API key (default: YUXI_KEY)")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    chat = commands.add_parser("chat", parents=[common],
                               help="talk to a session in the terminal (over the HTTP API)")
    which = chat.add_mutually_exclusive_group()
    which.add_argument("--session", type=_session_id, help="an existing session")
    which.add_argument("--agent", help="start a new session of this agent (by name)")
    chat.set_defaults(func=_run(_chat))

    tail = commands.add_parser("tail", parents=[common],
                               help="follow a session's events with a live status line")
    tail.add_argument("session", type=_session_id)
    tail.add_argument("--tree", action="store_true", help="the whole tree's events")
    tail.add_argument("--after", type=int, default=None,
                      help="start after this event number (default: from the start)")
    tail.set_defaults(func=_run(_tail))

    tree = commands.add_parser("tree", parents=[common], help="a session's member tree")
    tree.add_argument("session", type=_session_id)
    tree.set_defaults(func=_run(_tree))
