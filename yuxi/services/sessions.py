"""Sessions, inputs, turns and their results: what API clients call."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import uuid
from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.domain import (Input, Receipt, Run, Scope, Session, Turn, TurnResult, Usage,
                         from_row)
from yuxi.errors import IllegalTransition, InvalidRequest, NotFound
from yuxi.runtime.models import UnknownModelError, check_model_name
from yuxi.services.accounts import get_agent

APPROVAL_MODES = ("auto", "confirm")

# Schema defaults of a session config; the Agent's config and explicit values
# are laid over them at creation and frozen in the session.
CONFIG_DEFAULTS: dict[str, Any] = {
    "approval_mode": "auto",
    "system_prompt": "",
    "tools": [],
    "max_steps": 25,
    # Selection intent only ("all" or ["kind:name", ...]); grants are
    # resolved when a run starts.
    "resources": [],
}


def _field_error(field: str, message: str, code: str = "invalid_request") -> InvalidRequest:
    err = InvalidRequest(f"{field}: {message}", errors=[{"field": field, "message": message}])
    err.code = code
    return err


def _checked_model(name: str, field: str = "model") -> str:
    try:
        return check_model_name(name)
    except UnknownModelError as exc:
        raise _field_error(field, str(exc), code="unknown_model") from exc


def _checked_approval(mode: str, field: str = "approval_mode") -> str:
    if mode not in APPROVAL_MODES:
        raise _field_error(field, f"must be one of {', '.join(APPROVAL_MODES)}")
    return mode


async def create_session(
    pool: AsyncConnectionPool,
    scope: Scope,
    *,
    agent_id: uuid.UUID,
    default_model: str,
    title: str | None = None,
    model: str | None = None,
    approval_mode: str | None = None,
) -> Session:
    """A root session whose config is the Agent's, resolved and frozen now:
    later changes to the Agent or the system default never reach it."""
    agent = await get_agent(pool, scope, agent_id)
    config = {**CONFIG_DEFAULTS, **agent.config}
    config["model"] = _checked_model(model or agent.config.get("model") or default_model)
    config["approval_mode"] = _checked_approval(approval_mode or config["approval_mode"])
    async with pool.connection() as conn:
        row = await db.fetch_one(
            conn,
            "create_root_session",
            {**scope.params(), "agent_id": agent.id, "title": title, "config": Jsonb(config)},
        )
    return await get_session(pool, scope, row["id"])


async def get_session(pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID) -> Session:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "get_session", {**scope.params(), "id": session_id})
    if row is None:
        raise NotFound(f"session {session_id} not found", session_id=session_id)
    return Session.from_row(row)


def _encode_cursor(created_at: dt.datetime, id_: uuid.UUID) -> str:
    raw = f"{created_at.isoformat()}|{id_}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, _, id_ = raw.partition("|")
        return dt.datetime.fromisoformat(created), uuid.UUID(id_)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _field_error("cursor", "is not a cursor returned by this API") from exc


async def list_sessions(
    pool: AsyncConnectionPool, scope: Scope, *, limit: int = 50, cursor: str | None = None
) -> tuple[list[Session], str | None]:
    """Top-level sessions, newest first, keyset-paginated."""
    if not 1 <= limit <= 200:
        raise _field_error("limit", "must be between 1 and 200")
    after_created, after_id = _decode_cursor(cursor) if cursor else (None, None)
    async with pool.connection() as conn:
        rows = await db.fetch_all(
            conn,
            "list_root_sessions_after" if cursor else "list_root_sessions",
            {**scope.params(), "after_created": after_created, "after_id": after_id,
             "limit": limit + 1},
        )
    items = [Session.from_row(r) for r in rows[:limit]]
    next_cursor = _encode_cursor(rows[limit - 1]["created_at"], rows[limit - 1]["id"]) \
        if len(rows) > limit else None
    return items, next_cursor


async def update_session(
    pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID, changes: dict[str, Any]
) -> Session:
    """Change title, model or approval mode; only inputs received later see it."""
    checked: dict[str, Any] = {}
    for field, value in changes.items():
        if field not in ("title", "model", "approval_mode"):
            raise _field_error(field, "cannot be changed")
        if value is None:
            raise _field_error(field, "must not be null")
        if field == "model":
            value = _checked_model(value)
        elif field == "approval_mode":
            value = _checked_approval(value)
        checked[field] = value
    async with pool.connection() as conn:
        await db.fetch_one(
            conn, "update_session",
            {**scope.params(), "id": session_id, "changes": Jsonb(checked)},
        )
    return await get_session(pool, scope, session_id)


async def receive_input(
    pool: AsyncConnectionPool,
    scope: Scope,
    session_id: uuid.UUID,
    *,
    content: str,
    mode: str = "steer",
    model: str | None = None,
    approval_mode: str | None = None,
    client_request_id: str | None = None,
    by_user: bool = False,
) -> Receipt:
    """Durably receive an input; the same client_request_id returns the same
    receipt and creates nothing. `by_user`: a person acted on the session
    directly; when it is a member of a tree its parent gets a notice."""
    if not content.strip():
        raise _field_error("content", "must not be blank")
    if mode not in ("steer", "queue"):
        raise _field_error("mode", "must be steer or queue")
    if client_request_id is not None and not client_request_id.strip():
        raise _field_error("client_request_id", "must not be blank")
    overrides: dict[str, Any] = {}
    if model is not None:
        overrides["model"] = _checked_model(model)
    if approval_mode is not None:
        overrides["approval_mode"] = _checked_approval(approval_mode)
    async with pool.connection() as conn:  # one statement, one transaction
        info = await db.fetch_one(
            conn,
            "receive_input",
            {**scope.params(), "session_id": session_id, "content": content, "mode": mode,
             "overrides": Jsonb(overrides), "client_request_id": client_request_id,
             "by_user": by_user},
        )
    return Receipt(
        input_id=info["id"], session_id=info["session_id"], status=info["status"],
        turn_id=info["turn_id"], mode=info["mode"], position=info["position"],
    )


async def get_tree(pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID) -> list[dict]:
    """Every member of the session's tree (path order) with title, status,
    current turn and queue state."""
    session = await get_session(pool, scope, session_id)
    async with pool.connection() as conn:
        rows = await db.fetch_all(conn, "tree_sessions", {
            **scope.params(), "tree_id": session.tree_id, "parent": None, "after": "",
            "limit": 10_000})
    return [{"id": r["id"], "parent_id": r["parent_id"], "name": r["name"], "path": r["path"],
             "title": r["title"], "status": r["status"], "current_turn_id": r["current_turn_id"],
             "queue": {"length": r["queue_length"], "paused": r["queue_paused"]},
             "created_at": r["created_at"]} for r in rows]


async def tree_slot_use(pool: AsyncConnectionPool, tree_id: uuid.UUID) -> dict[str, int]:
    """Slots of a tree (the caller checked scope): capacity, held, waiting."""
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "tree_slot_use", {"tree_id": tree_id})
    return {k: int(row[k]) for k in ("capacity", "held", "waiting")}


async def get_input(pool: AsyncConnectionPool, scope: Scope, input_id: uuid.UUID) -> Input:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "get_input", {**scope.params(), "id": input_id})
    if row is None:
        raise NotFound(f"input {input_id} not found", input_id=input_id)
    return from_row(Input, row)


async def list_turns(pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID) -> list[Turn]:
    await get_session(pool, scope, session_id)
    async with pool.connection() as conn:
        rows = await db.fetch_all(
            conn, "list_turns", {**scope.params(), "session_id": session_id})
    return [from_row(Turn, r) for r in rows]


async def get_turn(pool: AsyncConnectionPool, scope: Scope, turn_id: uuid.UUID) -> Turn:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "get_turn", {**scope.params(), "id": turn_id})
        if row is None:
            raise NotFound(f"turn {turn_id} not found", turn_id=turn_id)
        runs = await db.fetch_all(conn, "runs_of_turn", {"turn_id": turn_id})
        wait = await db.fetch_one(conn, "pending_user_wait",
                                  {**scope.params(), "turn_id": turn_id})
    usages = [Usage(r["prompt_tokens"], r["completion_tokens"]) for r in runs]
    return from_row(Turn, {**row, "runs": [from_row(Run, {**r, "usage": u})
                                           for r, u in zip(runs, usages)],
                           "pending": public_request(wait) if wait else None,
                           "usage": Usage(sum(u.prompt_tokens for u in usages),
                                          sum(u.completion_tokens for u in usages))})


TERMINAL_TURN = frozenset({"completed", "failed", "cancelled"})
MAX_WAIT_SECONDS = 60.0


async def wait_result(pool: AsyncConnectionPool, hub: Any, scope: Scope, turn_id: uuid.UUID,
                      wait: float) -> TurnResult:
    """The turn's result as soon as it is terminal, or as it stands after
    `wait` seconds (at most 60). Woken by the notification of the turn's end
    (`yuxi_turns`, on the API process's one LISTEN connection), never by
    polling: one read before waiting and one after."""
    if wait <= 0:
        return from_row(TurnResult, await _result_row(pool, scope, turn_id))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait, MAX_WAIT_SECONDS)
    with hub.subscribe_turn(str(turn_id)) as wake:
        while True:
            wake.clear()  # before reading: a NOTIFY during the read wakes us again
            row = await _result_row(pool, scope, turn_id)
            left = deadline - loop.time()
            if row["status"] in TERMINAL_TURN or left <= 0:
                return from_row(TurnResult, row)
            try:
                await asyncio.wait_for(wake.wait(), timeout=left)
            except TimeoutError:
                pass


async def session_usage(pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID) -> Usage:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "session_usage", {**scope.params(),
                                                         "session_id": session_id})
    return Usage(row["prompt_tokens"], row["completion_tokens"])


async def tree_usage(pool: AsyncConnectionPool, scope: Scope, tree_id: uuid.UUID) -> Usage:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "tree_usage", {**scope.params(), "tree_id": tree_id})
    return Usage(row["prompt_tokens"], row["completion_tokens"])


_PUBLIC = {"approvals": ("call_id", "tool", "args"),
           "questions": ("id", "question", "options", "multi_select", "allow_other")}


def public_request(wait: dict[str, Any]) -> dict[str, Any]:
    """A pending user request as clients see it (no internal ids)."""
    out: dict[str, Any] = {"kind": wait["kind"]}
    for key, fields in _PUBLIC.items():
        if wait["request"].get(key):
            out[key] = [{f: item[f] for f in fields} for item in wait["request"][key]]
    return out


async def answer_turn(pool: AsyncConnectionPool, scope: Scope, turn_id: uuid.UUID, *,
                      decisions: list[dict[str, Any]] | None = None,
                      answers: dict[str, Any] | None = None) -> Turn:
    """Answer what the turn waits for (approval decisions and/or answers to
    questions); it resumes in a new run. Incomplete answers are a 422 that
    lists what is missing, and change nothing (the same answer can be sent
    again)."""
    from yuxi.runtime.questions import answer_errors

    async with pool.connection() as conn:
        wait = await db.fetch_one(conn, "pending_user_wait", {**scope.params(), "turn_id": turn_id})
    if wait is None:
        await get_turn(pool, scope, turn_id)  # 404 when it is not ours
        err = IllegalTransition(f"turn {turn_id} is not waiting for an answer")
        raise err
    request = wait["request"]
    resume: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    approvals = request.get("approvals") or []
    if approvals:
        given = {d.get("call_id"): d for d in decisions or [] if isinstance(d, dict)}
        for item in approvals:
            decision = given.get(item["call_id"])
            if decision is None or not isinstance(decision.get("approve"), bool):
                errors.append({"field": f"decisions.{item['call_id']}",
                               "message": f"missing decision for {item['tool']} call"})
            else:
                resume[item["interrupt_id"]] = {"approve": decision["approve"],
                                                "message": decision.get("message")}
        unknown = set(given) - {a["call_id"] for a in approvals}
        errors += [{"field": f"decisions.{u}", "message": "no such call"} for u in unknown]
    questions = request.get("questions") or []
    if questions:
        errors += answer_errors(questions, answers)
        if not errors:
            for q in questions:
                resume.setdefault(q["interrupt_id"], {})[q["id"]] = answers[q["id"]]
    if errors:
        raise InvalidRequest("the answer is incomplete: " + "; ".join(
            f"{e['field']}: {e['message']}" for e in errors), errors=errors)
    async with pool.connection() as conn:
        await db.fetch_one(conn, "answer_turn", {
            **scope.params(), "turn_id": turn_id, "wait_id": wait["id"],
            "answer": Jsonb(resume)})
    return await get_turn(pool, scope, turn_id)


async def get_result(pool: AsyncConnectionPool, scope: Scope, turn_id: uuid.UUID) -> TurnResult:
    """The exact result of a turn, read through its result_run_id."""
    return from_row(TurnResult, await _result_row(pool, scope, turn_id))


async def _result_row(pool: AsyncConnectionPool, scope: Scope, turn_id: uuid.UUID) -> dict:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "turn_result", {**scope.params(), "id": turn_id})
    if row is None:
        raise NotFound(f"turn {turn_id} not found", turn_id=turn_id)
    return row


async def cancel_turn(pool: AsyncConnectionPool, scope: Scope, turn_id: uuid.UUID,
                      *, by_user: bool = True) -> Turn:
    """Cancel exactly this turn (a queued one at once; one in flight
    converges). Cancelling an ended turn changes nothing."""
    async with pool.connection() as conn:
        await db.fetch_one(conn, "cancel_turn", {**scope.params(), "session_id": None,
                                                 "turn_id": turn_id})
    return await get_turn(pool, scope, turn_id)


async def stop_tree(pool: AsyncConnectionPool, scope: Scope, session_id: uuid.UUID) -> int:
    """Stop all: cancel in-flight turns down the whole tree and pause every
    member's queue."""
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "stop_tree",
                                   {**scope.params(), "session_id": session_id}))["turns"]


async def continue_queue(pool: AsyncConnectionPool, scope: Scope,
                         session_id: uuid.UUID) -> Session:
    """Resume a paused queue, FIFO head first; cancelled turns stay cancelled."""
    async with pool.connection() as conn:
        await db.fetch_one(conn, "continue_queue", {**scope.params(), "session_id": session_id})
    return await get_session(pool, scope, session_id)
