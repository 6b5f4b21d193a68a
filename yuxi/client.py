"""Python clients of the HTTP API: `Client` (sync) and `AsyncClient`.

Typed with msgspec (the API's own response Structs; unknown fields are
ignored, so a newer server stays readable). Errors are `ApiError` (the API's
`{code, message, errors}` body and the HTTP status) or `Unreachable` (no
answer at all). Event streams (SSE) yield `Event` (durable, numbered) and
`Delta` (ephemeral `message.delta` frames without `id:`) and reconnect by
themselves with `Last-Event-ID` after a broken connection: no gap, no
duplicate.

Every route a client calls is listed in `ROUTES` (method, OpenAPI path):
tests check each against `/schema/openapi.json`, the contract.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal, NamedTuple

import httpx
import msgspec

from yuxi.domain import Agent, Event, Input, Receipt, Session, Turn, TurnResult

__all__ = ["ApiError", "AsyncClient", "Client", "ClientError", "Delta", "Event", "ROUTES",
           "Tree", "TreeMember", "Unreachable"]


class ClientError(Exception):
    """A call of the API did not succeed."""


class Unreachable(ClientError):
    """The API did not answer (wrong URL, server down, network)."""


class ApiError(ClientError):
    """The API answered with an error status and its `{code, message, errors}` body."""

    def __init__(self, status: int, code: str, message: str,
                 errors: list[dict[str, Any]] | None = None) -> None:
        self.status, self.code, self.message = status, code, message
        self.errors = errors or []
        super().__init__(f"{message} (HTTP {status} {code})")


class Delta(msgspec.Struct, frozen=True):
    """An ephemeral frame (`message.delta`: a piece of a message still being
    written); never stored or replayed, so it carries no sequence number."""

    type: str
    data: dict[str, Any]

    @property
    def text(self) -> str:
        for key in ("delta", "text", "content"):
            if isinstance(value := self.data.get(key), str):
                return value
        return ""


class TreeMember(msgspec.Struct, frozen=True):
    id: uuid.UUID
    parent_id: uuid.UUID | None
    name: str
    path: str
    title: str | None
    status: str
    current_turn_id: uuid.UUID | None
    queue: dict[str, Any]


class Slots(msgspec.Struct, frozen=True):
    capacity: int
    held: int
    waiting: int


class Tree(msgspec.Struct, frozen=True):
    tree_id: uuid.UUID | None
    sessions: list[TreeMember]
    slots: Slots | None = None


class _Page(msgspec.Struct, frozen=True):
    items: list[Session]
    next_cursor: str | None


class Route(NamedTuple):
    method: str
    path: str  # as in the OpenAPI document


ROUTES: dict[str, Route] = {
    "list_agents": Route("GET", "/api/agents"),
    "create_agent": Route("POST", "/api/agents"),
    "create_session": Route("POST", "/api/sessions"),
    "list_sessions": Route("GET", "/api/sessions"),
    "get_session": Route("GET", "/api/sessions/{session_id}"),
    "update_session": Route("POST", "/api/sessions/{session_id}"),
    "send_input": Route("POST", "/api/sessions/{session_id}/inputs"),
    "stop": Route("POST", "/api/sessions/{session_id}/stop"),
    "continue_queue": Route("POST", "/api/sessions/{session_id}/queue/continue"),
    "tree": Route("GET", "/api/sessions/{session_id}/tree"),
    "turns": Route("GET", "/api/sessions/{session_id}/turns"),
    "messages": Route("GET", "/api/sessions/{session_id}/messages"),
    "events": Route("GET", "/api/sessions/{session_id}/events"),
    "get_input": Route("GET", "/api/inputs/{input_id}"),
    "get_turn": Route("GET", "/api/turns/{turn_id}"),
    "cancel_turn": Route("POST", "/api/turns/{turn_id}/cancel"),
    "answer_turn": Route("POST", "/api/turns/{turn_id}/answer"),
    "get_result": Route("GET", "/api/turns/{turn_id}/result"),
    "healthz": Route("GET", "/api/healthz"),
}


class _Call(NamedTuple):
    route: Route
    ids: dict[str, Any]
    body: Any
    params: dict[str, Any] | None
    type: Any


def _call(name: str, type_: Any, *, body: Any = None, params: dict[str, Any] | None = None,
          **ids: Any) -> _Call:
    return _Call(ROUTES[name], ids, body, params, type_)


def _url(call: _Call) -> str:
    return call.route.path.format(**{k: str(v) for k, v in call.ids.items()})


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    raise ApiError(response.status_code, str(body.get("code") or "error"),
                   str(body.get("message") or body.get("detail") or response.reason_phrase),
                   body.get("errors") if isinstance(body.get("errors"), list) else None)


def _decode(call: _Call, response: httpx.Response) -> Any:
    _raise_for(response)
    if call.type is None:
        return response.json()
    return msgspec.json.decode(response.content, type=call.type)


# --------------------------------------------------------------------------
# The calls (one builder per route, shared by both clients)


class _Calls:
    """Builders of every call; `Client` and `AsyncClient` execute them."""

    @staticmethod
    def list_agents() -> _Call:
        return _call("list_agents", list[Agent])

    @staticmethod
    def create_agent(name: str, config: dict[str, Any]) -> _Call:
        return _call("create_agent", Agent, body={"name": name, "config": config})

    @staticmethod
    def create_session(agent_id: uuid.UUID | str, *, title: str | None = None,
                       model: str | None = None, approval_mode: str | None = None) -> _Call:
        return _call("create_session", Session, body=_drop_none({
            "agent_id": str(agent_id), "title": title, "model": model,
            "approval_mode": approval_mode}))

    @staticmethod
    def list_sessions(*, limit: int = 50, cursor: str | None = None) -> _Call:
        return _call("list_sessions", _Page, params=_drop_none({"limit": limit, "cursor": cursor}))

    @staticmethod
    def get_session(session_id) -> _Call:
        return _call("get_session", Session, session_id=session_id)

    @staticmethod
    def update_session(session_id, **changes: Any) -> _Call:
        return _call("update_session", Session, body=changes, session_id=session_id)

    @staticmethod
    def send_input(session_id, content: str, *, mode: Literal["steer", "queue"] = "steer",
                   model: str | None = None, approval_mode: str | None = None,
                   client_request_id: str | None = None) -> _Call:
        return _call("send_input", Receipt, session_id=session_id, body=_drop_none({
            "content": content, "mode": mode, "model": model, "approval_mode": approval_mode,
            "client_request_id": client_request_id}))

    @staticmethod
    def stop(session_id) -> _Call:
        return _call("stop", dict[str, int], session_id=session_id)

    @staticmethod
    def continue_queue(session_id) -> _Call:
        return _call("continue_queue", Session, session_id=session_id)

    @staticmethod
    def tree(session_id) -> _Call:
        return _call("tree", Tree, session_id=session_id)

    @staticmethod
    def turns(session_id) -> _Call:
        return _call("turns", list[Turn], session_id=session_id)

    @staticmethod
    def messages(session_id, limit: int | None = None, before: int | None = None) -> _Call:
        return _call("messages", list[dict[str, Any]],
                     params=_drop_none({"limit": limit, "before": before}), session_id=session_id)

    @staticmethod
    def get_input(input_id) -> _Call:
        return _call("get_input", Input, input_id=input_id)

    @staticmethod
    def get_turn(turn_id) -> _Call:
        return _call("get_turn", Turn, turn_id=turn_id)

    @staticmethod
    def cancel_turn(turn_id) -> _Call:
        return _call("cancel_turn", Turn, turn_id=turn_id)

    @staticmethod
    def answer_turn(turn_id, *, decisions: list[dict[str, Any]] | None = None,
                    answers: dict[str, Any] | None = None) -> _Call:
        return _call("answer_turn", Turn, turn_id=turn_id,
                     body=_drop_none({"decisions": decisions, "answers": answers}))

    @staticmethod
    def get_result(turn_id) -> _Call:
        return _call("get_result", TurnResult, turn_id=turn_id)

    @staticmethod
    def healthz() -> _Call:
        return _call("healthz", dict[str, str])


# --------------------------------------------------------------------------
# Server-Sent Events


class _SseParser:
    """Lines in, (id, event, data) frames out (the WHATWG rules we need)."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.event: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> Event | Delta | None:
        if line == "":
            frame = self._frame()
            self.id, self.event, self.data = None, None, []
            return frame
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            self.id = value
        elif name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None

    def _frame(self) -> Event | Delta | None:
        if not self.data:
            return None
        text = "\n".join(self.data)
        if self.id:
            return msgspec.json.decode(text, type=Event)
        raw = msgspec.json.decode(text)
        if not isinstance(raw, dict):
            return None
        type_ = self.event or str(raw.get("type") or "message.delta")
        data = raw.get("data") if isinstance(raw.get("data"), dict) else raw
        return Delta(type=type_, data=data)


def _event_request(session_id, scope: str, cursor: int | None) -> tuple[str, dict, dict]:
    params: dict[str, Any] = {"scope": scope}
    headers = {"Accept": "text/event-stream"}
    if cursor:
        headers["Last-Event-ID"] = str(cursor)
    return _url(_call("events", None, session_id=session_id)), params, headers


# A stream with no frame at all (not even a keepalive comment) for this long
# is taken as broken and reopened.
STREAM_READ_TIMEOUT = 60.0
RECONNECT_BACKOFF = (0.1, 0.25, 0.5, 1.0, 2.0)
# How long a stream keeps trying while the API refuses connections (a
# restart, a deploy) before it raises Unreachable.
RECONNECT_GIVE_UP = 60.0


class _Reconnect:
    """Backoff and the give-up deadline of a stream's reconnects."""

    def __init__(self, url: str) -> None:
        self.url, self.failures, self.down_since = url, 0, None

    def connected(self) -> None:
        self.failures, self.down_since = 0, None

    def failed(self, exc: httpx.TransportError) -> float:
        now = time.monotonic()
        if isinstance(exc, httpx.ConnectError):
            self.down_since = self.down_since or now
            if now - self.down_since > RECONNECT_GIVE_UP:
                raise Unreachable(f"cannot reach {self.url}: {exc}") from exc
        delay = RECONNECT_BACKOFF[min(self.failures, len(RECONNECT_BACKOFF) - 1)]
        self.failures += 1
        return delay


def _sse_timeout(timeout: float) -> httpx.Timeout:
    return httpx.Timeout(timeout, read=STREAM_READ_TIMEOUT)


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# --------------------------------------------------------------------------
# Clients


class Client:
    """Blocking client. `Client(url, key)`; use as a context manager or close()."""

    def __init__(self, url: str, key: str | None, *, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self._http = httpx.Client(base_url=self.url, headers=_headers(key), timeout=timeout,
                                  transport=transport)
        self.reconnects = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _do(self, call: _Call) -> Any:
        try:
            response = self._http.request(call.route.method, _url(call), json=call.body,
                                          params=call.params)
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach {self.url}: {exc}") from exc
        return _decode(call, response)

    def list_agents(self) -> list[Agent]: return self._do(_Calls.list_agents())
    def create_agent(self, name: str, config: dict[str, Any]) -> Agent:
        return self._do(_Calls.create_agent(name, config))
    def create_session(self, agent_id, **kw: Any) -> Session:
        return self._do(_Calls.create_session(agent_id, **kw))
    def list_sessions(self, **kw: Any) -> _Page: return self._do(_Calls.list_sessions(**kw))
    def get_session(self, session_id) -> Session: return self._do(_Calls.get_session(session_id))
    def update_session(self, session_id, **changes: Any) -> Session:
        return self._do(_Calls.update_session(session_id, **changes))
    def send_input(self, session_id, content: str, **kw: Any) -> Receipt:
        return self._do(_Calls.send_input(session_id, content, **kw))
    def stop(self, session_id) -> dict[str, int]: return self._do(_Calls.stop(session_id))
    def continue_queue(self, session_id) -> Session:
        return self._do(_Calls.continue_queue(session_id))
    def tree(self, session_id) -> Tree: return self._do(_Calls.tree(session_id))
    def turns(self, session_id) -> list[Turn]: return self._do(_Calls.turns(session_id))
    def messages(self, session_id, limit: int | None = None,
                 before: int | None = None) -> list[dict[str, Any]]:
        """A page of the conversation, oldest first (the newest `limit`,
        server default 100, before position `before`)."""
        return self._do(_Calls.messages(session_id, limit, before))
    def get_input(self, input_id) -> Input: return self._do(_Calls.get_input(input_id))
    def get_turn(self, turn_id) -> Turn: return self._do(_Calls.get_turn(turn_id))
    def cancel_turn(self, turn_id) -> Turn: return self._do(_Calls.cancel_turn(turn_id))
    def answer_turn(self, turn_id, **kw: Any) -> Turn:
        return self._do(_Calls.answer_turn(turn_id, **kw))
    def get_result(self, turn_id) -> TurnResult: return self._do(_Calls.get_result(turn_id))
    def healthz(self) -> dict[str, str]: return self._do(_Calls.healthz())

    def events(self, session_id, *, scope: str = "session",
               after: int | None = None) -> Iterator[Event | Delta]:
        """Follow a session's (or its tree's) events forever, from after
        `after`; a broken connection is reopened with Last-Event-ID."""
        cursor, retry = after, _Reconnect(self.url)
        while True:
            path, params, headers = _event_request(session_id, scope, cursor)
            delay = RECONNECT_BACKOFF[0]  # also after a clean end of the stream
            try:
                with self._http.stream("GET", path, params=params, headers=headers,
                                       timeout=_sse_timeout(self.timeout)) as response:
                    if response.status_code >= 400:
                        response.read()
                        _raise_for(response)
                    retry.connected()
                    parser = _SseParser()
                    for line in response.iter_lines():
                        item = parser.feed(line)
                        if isinstance(item, Event):
                            cursor = item.seq
                        if item is not None:
                            yield item
            except httpx.TransportError as exc:
                delay = retry.failed(exc)
            time.sleep(delay)
            self.reconnects += 1


class AsyncClient:
    """asyncio client; the same methods as `Client`, awaited."""

    def __init__(self, url: str, key: str | None, *, timeout: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout
        self._http = httpx.AsyncClient(base_url=self.url, headers=_headers(key),
                                       timeout=timeout, transport=transport)
        self.reconnects = 0

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _do(self, call: _Call) -> Any:
        try:
            response = await self._http.request(call.route.method, _url(call), json=call.body,
                                                params=call.params)
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach {self.url}: {exc}") from exc
        return _decode(call, response)

    async def list_agents(self) -> list[Agent]: return await self._do(_Calls.list_agents())
    async def create_agent(self, name: str, config: dict[str, Any]) -> Agent:
        return await self._do(_Calls.create_agent(name, config))
    async def create_session(self, agent_id, **kw: Any) -> Session:
        return await self._do(_Calls.create_session(agent_id, **kw))
    async def list_sessions(self, **kw: Any) -> _Page:
        return await self._do(_Calls.list_sessions(**kw))
    async def get_session(self, session_id) -> Session:
        return await self._do(_Calls.get_session(session_id))
    async def update_session(self, session_id, **changes: Any) -> Session:
        return await self._do(_Calls.update_session(session_id, **changes))
    async def send_input(self, session_id, content: str, **kw: Any) -> Receipt:
        return await self._do(_Calls.send_input(session_id, content, **kw))
    async def stop(self, session_id) -> dict[str, int]:
        return await self._do(_Calls.stop(session_id))
    async def continue_queue(self, session_id) -> Session:
        return await self._do(_Calls.continue_queue(session_id))
    async def tree(self, session_id) -> Tree: return await self._do(_Calls.tree(session_id))
    async def turns(self, session_id) -> list[Turn]:
        return await self._do(_Calls.turns(session_id))
    async def messages(self, session_id, limit: int | None = None,
                       before: int | None = None) -> list[dict[str, Any]]:
        return await self._do(_Calls.messages(session_id, limit, before))
    async def get_input(self, input_id) -> Input: return await self._do(_Calls.get_input(input_id))
    async def get_turn(self, turn_id) -> Turn: return await self._do(_Calls.get_turn(turn_id))
    async def cancel_turn(self, turn_id) -> Turn:
        return await self._do(_Calls.cancel_turn(turn_id))
    async def answer_turn(self, turn_id, **kw: Any) -> Turn:
        return await self._do(_Calls.answer_turn(turn_id, **kw))
    async def get_result(self, turn_id) -> TurnResult:
        return await self._do(_Calls.get_result(turn_id))
    async def healthz(self) -> dict[str, str]: return await self._do(_Calls.healthz())

    async def events(self, session_id, *, scope: str = "session",
                     after: int | None = None) -> AsyncIterator[Event | Delta]:
        """Follow a session's (or its tree's) events forever, from after
        `after`; a broken connection is reopened with Last-Event-ID."""
        cursor, retry = after, _Reconnect(self.url)
        while True:
            path, params, headers = _event_request(session_id, scope, cursor)
            delay = RECONNECT_BACKOFF[0]  # also after a clean end of the stream
            try:
                async with self._http.stream("GET", path, params=params, headers=headers,
                                             timeout=_sse_timeout(self.timeout)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        _raise_for(response)
                    retry.connected()
                    parser = _SseParser()
                    async for line in response.aiter_lines():
                        item = parser.feed(line)
                        if isinstance(item, Event):
                            cursor = item.seq
                        if item is not None:
                            yield item
            except httpx.TransportError as exc:
                delay = retry.failed(exc)
            await asyncio.sleep(delay)
            self.reconnects += 1
