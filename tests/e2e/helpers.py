"""Helpers of the e2e tests: an API client, an SSE reader, polling with
deadlines and direct reads of PostgreSQL.

Nothing here sleeps and hopes: every wait is a poll or a stream read bounded
by a deadline, and a timeout says what was seen so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import psycopg
from psycopg.rows import dict_row

# --------------------------------------------------------------------------
# HTTP


def client(base_url: str, key: str | None) -> httpx.AsyncClient:
    """An API client for one key (None: no Authorization header)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.AsyncClient(base_url=base_url, headers=headers,
                             timeout=httpx.Timeout(10.0, read=10.0))


def ok(response: httpx.Response, status: int = 200) -> Any:
    """The JSON body of a response that must have `status`."""
    assert response.status_code == status, (
        f"{response.request.method} {response.request.url}: expected {status}, "
        f"got {response.status_code}: {response.text}")
    return response.json()


async def create_agent(api: httpx.AsyncClient, config: dict[str, Any],
                       name: str = "agent") -> dict[str, Any]:
    return ok(await api.post("/api/agents", json={"name": name, "config": config}), 201)


async def create_session(api: httpx.AsyncClient, agent_id: str, **extra: Any) -> dict[str, Any]:
    return ok(await api.post("/api/sessions", json={"agent_id": agent_id, **extra}), 201)


async def session_with_script(api: httpx.AsyncClient, script: dict[str, Any],
                              *, tools: list[str] | None = None,
                              name: str = "agent") -> dict[str, Any]:
    """A new session of a new `replay` agent running `script`."""
    config: dict[str, Any] = {"model": "replay", "replay": script}
    if tools:
        config["tools"] = tools
    agent = await create_agent(api, config, name=name)
    return await create_session(api, agent["id"])


async def post_input(api: httpx.AsyncClient, session_id: str, content: str,
                     **extra: Any) -> dict[str, Any]:
    return ok(await api.post(f"/api/sessions/{session_id}/inputs",
                             json={"content": content, **extra}), 202)


async def result_of(api: httpx.AsyncClient, turn_id: str) -> dict[str, Any]:
    return ok(await api.get(f"/api/turns/{turn_id}/result"))


async def wait_turn_done(api: httpx.AsyncClient, turn_id: str,
                         timeout: float = 20.0) -> dict[str, Any]:
    """Poll a turn until it is terminal; returns the turn (with runs)."""
    async def done() -> dict[str, Any] | None:
        turn = ok(await api.get(f"/api/turns/{turn_id}"))
        return turn if turn["status"] in ("completed", "failed", "cancelled") else None
    return await wait_for(done, timeout, f"turn {turn_id} to end")


# --------------------------------------------------------------------------
# Polling


async def wait_for(probe: Callable[[], Awaitable[Any]], timeout: float, what: str,
                   interval: float = 0.1) -> Any:
    """Call `probe` until it returns something truthy (returned) or the
    deadline passes (AssertionError naming `what` and the last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------
# Server-Sent Events


@dataclass
class Frame:
    """One SSE frame: `comments` are the `:` lines (keepalives)."""

    id: str | None = None
    event: str | None = None
    data: str | None = None
    retry: int | None = None
    comments: list[str] = field(default_factory=list)


async def sse_frames(response: httpx.Response) -> AsyncIterator[Frame]:
    """Parse an SSE body (any of \\r\\n, \\n, \\r line ends) into frames."""
    frame = Frame()
    data: list[str] = []
    dirty = False
    async for line in response.aiter_lines():
        if line == "":
            if dirty:
                frame.data = "\n".join(data) if data else None
                yield frame
            frame, data, dirty = Frame(), [], False
            continue
        dirty = True
        if line.startswith(":"):
            frame.comments.append(line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            frame.id = value
        elif name == "event":
            frame.event = value
        elif name == "data":
            data.append(value)
        elif name == "retry":
            frame.retry = int(value)


class EventStream:
    """An open event stream of a session. `events` holds every event read so
    far (the decoded `data:` payloads, in arrival order), `comments` every
    comment line; `read_until` reads on until a condition holds."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.events: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.comments: list[str] = []
        # `message.delta` frames (data), in arrival order.
        self.deltas: list[dict[str, Any]] = []
        self._frames = sse_frames(response)

    @property
    def seqs(self) -> list[int]:
        return [e["seq"] for e in self.events]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def read_until(self, done: Callable[[EventStream], bool],
                         timeout: float = 20.0) -> EventStream:
        """Read frames until `done(self)` is true; AssertionError (listing what
        arrived) when `timeout` passes or the stream ends first."""
        if done(self):
            return self
        try:
            async with asyncio.timeout(timeout):
                async for frame in self._frames:
                    self.comments.extend(frame.comments)
                    if frame.data is not None:
                        event = json.loads(frame.data)
                        if event.get("type") == "message.delta":
                            # Ephemeral: no id line, no seq, never replayed.
                            assert frame.id is None, frame
                            self.deltas.append(event)
                            if done(self):
                                return self
                            continue
                        assert frame.id == str(event["seq"]), (frame.id, event)
                        self.ids.append(frame.id)
                        self.events.append(event)
                    if done(self):
                        return self
        except TimeoutError:
            raise AssertionError(
                f"SSE: condition not met within {timeout}s; events so far: "
                f"{[(e['seq'], e['type']) for e in self.events]}") from None
        raise AssertionError(f"SSE: stream ended; events so far: {self.types()}")

    async def read_until_closed(self, timeout: float) -> None:
        """Read on until the server ends the stream (cleanly or by closing the
        connection); AssertionError when it is still open after `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                async for frame in self._frames:
                    self.comments.extend(frame.comments)
                    if frame.data is not None:
                        self.events.append(json.loads(frame.data))
        except TimeoutError:
            raise AssertionError(
                f"SSE: the stream is still open after {timeout}s "
                f"({self.comments.count('keepalive')} keepalives so far)") from None
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server closed the connection: ended too


def has_event(type_: str, *, turn_id: str | None = None,
              count: int = 1) -> Callable[[EventStream], bool]:
    """A `read_until` condition: `count` events of `type_` (of one turn)."""
    def check(stream: EventStream) -> bool:
        return sum(1 for e in stream.events if e["type"] == type_
                   and (turn_id is None or e["turn_id"] == turn_id)) >= count
    return check


@contextlib.asynccontextmanager
async def open_stream(api: httpx.AsyncClient, session_id: str, *, scope: str = "session",
                      after: int | None = None, last_event_id: int | str | None = None,
                      expect: int = 200) -> AsyncIterator[EventStream]:
    """Open `GET /api/sessions/{id}/events`; the stream closes on exit (a
    client disconnect)."""
    params: dict[str, Any] = {"scope": scope}
    if after is not None:
        params["after"] = after
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    async with api.stream("GET", f"/api/sessions/{session_id}/events", params=params,
                          headers=headers, timeout=httpx.Timeout(10.0, read=10.0)) as response:
        if response.status_code != expect:
            await response.aread()
            raise AssertionError(f"events of {session_id}: expected {expect}, got "
                                 f"{response.status_code}: {response.text}")
        assert response.headers["content-type"].startswith("text/event-stream")
        yield EventStream(response)


# --------------------------------------------------------------------------
# PostgreSQL


class Db:
    """Direct reads of the test database (autocommit: no snapshot is held
    between reads, no lock is held between tests)."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)

    def rows(self, sql: str, params: Any = None) -> list[dict[str, Any]]:
        return self.conn.execute(sql, params).fetchall()

    def one(self, sql: str, params: Any = None) -> dict[str, Any] | None:
        return self.conn.execute(sql, params).fetchone()

    def scalar(self, sql: str, params: Any = None) -> Any:
        row = self.conn.execute(sql, params).fetchone()
        return None if row is None else next(iter(row.values()))

    def events(self, tree_id: str, session_id: str | None = None) -> list[dict[str, Any]]:
        """The events of a tree (or one session of it) in sequence order, as
        the API serializes them (ids as text)."""
        rows = self.rows(
            """SELECT seq, type, session_id::text, turn_id::text, run_id::text, data
                 FROM yuxi.events
                WHERE tree_id = %s AND (%s::uuid IS NULL OR session_id = %s::uuid)
                ORDER BY seq""", (tree_id, session_id, session_id))
        return rows

    def counts(self) -> dict[str, int]:
        """Row counts of the tables a write would touch."""
        tables = ("sessions", "trees", "inputs", "turns", "runs", "events", "slot_claims",
                  "agents")
        out = {t: self.scalar(f"SELECT count(*) FROM yuxi.{t}") for t in tables}
        # Run jobs only: the periodic recovery sweep comes and goes by itself.
        out["run_jobs"] = self.run_jobs()
        return out

    def run_jobs(self) -> int:
        """execute_run jobs still stored (a successful job is deleted just
        after its run ended: wait for 0 before comparing counts)."""
        return self.scalar("SELECT count(*) FROM procrastinate.procrastinate_jobs "
                           "WHERE task_name = 'execute_run'")

    def close(self) -> None:
        self.conn.close()


def strip_event(event: dict[str, Any]) -> dict[str, Any]:
    """The fields an SSE event and a DB row have in common."""
    return {k: event[k] for k in ("seq", "type", "session_id", "turn_id", "run_id", "data")}
