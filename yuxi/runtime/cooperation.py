"""The eight cooperation tools. Their names and behaviour are part of the
contract:

create_session, send_message, submit_input, cancel_turn — side effects,
recorded as effects keyed by (source turn, tool call id): a replay through a
later run of the same turn returns the stored result and changes nothing.
wait_sessions, wait_inputs — return at once when something already happened,
otherwise suspend the run (`interrupt()`); the run's slot and worker job are
released until the wait is satisfied or times out.
list_sessions, get_result — reads.

Every tool runs with the scope of the run's session: targets are resolved
in that scope, and anything else is refused with a structured error result.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any

import msgspec
from langgraph.types import interrupt
from psycopg.types.json import Jsonb

from yuxi import db
from yuxi.errors import LeaseLost, is_connection_error
from yuxi.runtime.group_commit import GroupCommit
from yuxi.runtime.tools import Tool, ToolContext, ToolError, ToolOutput, register
from yuxi.services import accounts, sessions

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_WAIT_SECONDS = 3600.0
DEFAULT_WAIT_SECONDS = 300.0

# JSON schemas offered to models that bind tools (the replay model ignores them).
SCHEMAS: dict[str, dict[str, Any]] = {
    "create_session": {
        "description": "Create a child session and give it its first task.",
        "properties": {
            "name": {"type": "string", "pattern": NAME.pattern,
                     "description": "a local name, not a path: no '/', not '.' or '..'"},
            "task": {"type": "string", "minLength": 1},
            "title": {"type": "string"},
            "agent": {"type": "string", "description": "id or name of another agent"},
        },
        "required": ["name", "task"],
    },
    "send_message": {"description": "Send a message to another session of your tree (it starts no work).",
        "properties": {"session": {"type": "string"}, "text": {"type": "string"}},
                     "required": ["session", "text"]},
    "submit_input": {"description": "Give a session work: an input queued (or steering its running turn).",
        "properties": {"session": {"type": "string"}, "text": {"type": "string"},
                                    "mode": {"enum": ["steer", "queue"]}},
                     "required": ["session", "text"]},
    "cancel_turn": {"description": "Cancel exactly one turn of a session.",
        "properties": {"session": {"type": "string"}, "turn_id": {"type": "string"}},
                    "required": ["session", "turn_id"]},
    "wait_sessions": {"description": "Wait until the given sessions have news (a turn ended, a message).",
        "properties": {"sessions": {"type": "array", "items": {"type": "string"},
                                                  "minItems": 1},
                                     "timeout_s": {"type": "number"}},
                      "required": ["sessions"]},
    "list_sessions": {"description": "List the sessions of your tree (or your children) with their state.",
        "properties": {"scope": {"enum": ["tree", "children"]},
                                     "cursor": {"type": "string"},
                                     "limit": {"type": "integer"}}},
    "wait_inputs": {"description": "Wait until the given inputs' turns have ended.",
        "properties": {"input_ids": {"type": "array", "items": {"type": "string"},
                                                 "minItems": 1},
                                   "timeout_s": {"type": "number"}},
                    "required": ["input_ids"]},
    "get_result": {"description": "The exact result of an input or turn.",
        "properties": {"input_id": {"type": "string"},
                                  "turn_id": {"type": "string"}}},
}


def _text(args: dict[str, Any], key: str, *, required: bool = True) -> str | None:
    value = args.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ToolError("invalid_arguments", f"{key} must be a non-empty string")
    return value


def _uuid(value: Any, key: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ToolError("invalid_arguments", f"{key} must be an id, got {value!r}") from None


def _timeout(args: dict[str, Any]) -> float:
    value = args.get("timeout_s", DEFAULT_WAIT_SECONDS)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ToolError("invalid_arguments", "timeout_s must be a number of seconds >= 0")
    return min(float(value), MAX_WAIT_SECONDS)


def fingerprint(tool: str, request: dict[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode([tool, request], order="sorted")).hexdigest()


async def _effect(ctx: ToolContext, tool: str, request: dict[str, Any], perform) -> Any:
    """Perform a side effect once per (turn, tool call), in one transaction
    fenced by the run's lease: a replay returns the recorded result; the same
    key with another request is refused."""
    key = fingerprint(tool, request)
    async with db.transaction(ctx.pool) as conn:
        await db.execute(conn, "check_lease", {"run_id": ctx.run_id, "token": ctx.token})
        found = await db.fetch_one(conn, "find_effect", {
            "turn_id": ctx.run["turn_id"], "call_id": ctx.call_id, "tool": tool,
            "fingerprint": key})
        if found["result"] is not None:
            return found["result"]
        result = await perform(conn)
        await db.execute(conn, "record_effect", {
            "run_id": ctx.run_id, "call_id": ctx.call_id, "tool": tool, "fingerprint": key,
            "result": Jsonb(result)})
    return result


async def _resolve(conn, ctx: ToolContext, ref: Any) -> dict[str, Any]:
    if not isinstance(ref, str) or not ref.strip():
        raise ToolError("invalid_arguments", "session must be a session id or a path")
    return await db.fetch_one(conn, "resolve_session",
                              {"caller": ctx.run["session_id"], "ref": ref.strip()})


async def _child_config(ctx: ToolContext, agent_ref: str | None) -> tuple[Any, dict]:
    """The dispatching run's actual config, or an explicitly chosen agent's
    config frozen now."""
    if agent_ref is None:
        return None, ctx.run["config"]
    scope = _scope(ctx)
    agents = await accounts.list_agents(ctx.pool, scope)
    agent = next((a for a in agents if str(a.id) == agent_ref or a.name == agent_ref), None)
    if agent is None:
        raise ToolError("not_found", f"no agent {agent_ref!r} in this scope")
    config = {**sessions.CONFIG_DEFAULTS, **agent.config}
    config["model"] = agent.config.get("model") or ctx.run["config"].get("model") \
        or ctx.default_model
    return agent.id, config


def _scope(ctx: ToolContext):
    from yuxi.domain import Scope

    return Scope(user_id=ctx.run["user_id"], app_id=ctx.run["app_id"])


async def create_session(ctx: ToolContext, args: dict[str, Any]) -> Any:
    name = _text(args, "name")
    if not NAME.match(name) or name in (".", ".."):
        raise ToolError("invalid_name", f"{name!r} is not a session name: use 1-64 letters, "
                        "digits, '.', '_' or '-' (a name, not a path)")
    task = _text(args, "task")
    title = _text(args, "title", required=False)
    agent_ref = _text(args, "agent", required=False)
    request = {"name": name, "task": task, "title": title, "agent": agent_ref}
    if agent_ref is None:
        # The usual case (the dispatching run's config): the whole effect is
        # one statement, together with the step's other calls (a fan-out).
        call = {"call_id": ctx.call_id, "fingerprint": fingerprint("create_session", request),
                "name": name, "title": title, "task": task}
        if ctx.creates is not None:
            return await ctx.creates.submit(call)
        return (await create_sessions(ctx.pool, ctx.run_id, ctx.token, ctx.run["config"],
                                      [call]))[0]

    async def perform(conn) -> dict[str, Any]:
        agent_id, config = await _child_config(ctx, agent_ref)
        row = await db.fetch_one(conn, "create_child_session", {
            "parent": ctx.run["session_id"], "run_id": ctx.run_id, "name": name,
            "title": title, "agent_id": agent_id, "config": Jsonb(config), "task": task})
        first = await db.fetch_one(conn, "first_input_of", {"session_id": row["id"]})
        return {"session_id": str(row["id"]), "name": name, "path": first["path"],
                "input_id": str(first["input_id"]),
                "turn_id": str(first["turn_id"]) if first["turn_id"] else None}

    return await _effect(ctx, "create_session", request, perform)


async def create_sessions(pool, run_id: uuid.UUID, token: uuid.UUID, config: dict[str, Any],
                          calls: list[dict[str, Any]]) -> list[Any]:
    """create_session effects of one run with its own config, in one
    statement (create_session_effects_v1); their tool results, in order."""
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "create_session_effects", {
            "run_id": run_id, "token": token, "config": Jsonb(config), "calls": Jsonb(calls)})
    return row["results"]


def create_batch(pool, run_id: uuid.UUID, token: uuid.UUID,
                 config: dict[str, Any]) -> GroupCommit:
    """The create_session calls of a run's steps, made in batches (a
    fan-out's 64 calls in a few statements). A batch that fails is made again
    call by call, so that an error (a name taken, a call id reused with
    another request) is the result of its own call only."""
    async def flush(calls: list[dict[str, Any]]) -> list[Any]:
        try:
            return await create_sessions(pool, run_id, token, config, calls)
        except Exception as exc:
            if len(calls) == 1 or isinstance(exc, LeaseLost) or is_connection_error(exc):
                raise
        outcomes: list[Any] = []
        for call in calls:
            try:
                outcomes.append((await create_sessions(pool, run_id, token, config, [call]))[0])
            except Exception as exc:  # that call's own error
                outcomes.append(exc)
        return outcomes

    return GroupCommit(flush, limit=CREATE_BATCH)


# The most create_session calls in one statement: a batch holds the tree's
# lock (create_children_v1, set-based: ~0.3 ms a call here, so ~20 ms for
# 64), and a child's claim waits for it. A 64-call fan-out in one statement
# instead of four: its root suspends, freeing its slot, ~15 ms sooner.
CREATE_BATCH = 64


async def send_message(ctx: ToolContext, args: dict[str, Any]) -> Any:
    text = _text(args, "text")

    async def perform(conn) -> dict[str, Any]:
        target = await _resolve(conn, ctx, args.get("session"))
        row = await db.fetch_one(conn, "send_message", {
            "run_id": ctx.run_id, "receiver": target["id"], "content": text})
        return {"message_id": str(row["id"]), "session_id": str(target["id"]),
                "path": target["path"]}

    return await _effect(ctx, "send_message",
                         {"session": args.get("session"), "text": text}, perform)


async def submit_input(ctx: ToolContext, args: dict[str, Any]) -> Any:
    text = _text(args, "text")
    mode = args.get("mode", "queue")
    if mode not in ("steer", "queue"):
        raise ToolError("invalid_arguments", "mode must be steer or queue")

    async def perform(conn) -> dict[str, Any]:
        target = await _resolve(conn, ctx, args.get("session"))
        info = await db.fetch_one(conn, "receive_input", {
            **_scope(ctx).params(), "session_id": target["id"], "content": text, "mode": mode,
            "overrides": Jsonb({}), "client_request_id": None, "by_user": False})
        return {"input_id": str(info["id"]), "session_id": str(target["id"]),
                "path": target["path"], "status": info["status"],
                "turn_id": str(info["turn_id"]) if info["turn_id"] else None,
                "position": info["position"]}

    return await _effect(ctx, "submit_input",
                         {"session": args.get("session"), "text": text, "mode": mode}, perform)


async def cancel_turn(ctx: ToolContext, args: dict[str, Any]) -> Any:
    turn_id = _uuid(args.get("turn_id"), "turn_id")

    async def perform(conn) -> dict[str, Any]:
        target = await _resolve(conn, ctx, args.get("session"))
        row = await db.fetch_one(conn, "cancel_turn", {
            **_scope(ctx).params(), "session_id": target["id"], "turn_id": turn_id})
        return {"turn_id": str(turn_id), "session_id": str(target["id"]), "status": row["status"]}

    return await _effect(ctx, "cancel_turn",
                         {"session": args.get("session"), "turn_id": str(turn_id)}, perform)


def _one_wait_per_step(ctx: ToolContext) -> None:
    if ctx.waits_in_step > 1:
        raise ToolError("one_wait_per_step",
                        "call one wait tool per step; merge the targets into one call")


# The kinds of the wait tools' interrupts (the executor tells them from a
# user's approvals and questions).
WAIT_KINDS = ("sessions", "inputs")


async def _suspend_or_answer(ctx: ToolContext, kind: str, targets: list[uuid.UUID],
                             cursor: dict[str, int], timeout: float) -> dict[str, Any]:
    """Suspend the run (the resume run re-executes this tool from its start);
    returns the resume payload: {"reason": satisfied|steer|timeout|ready|cycle}.
    The interrupt names the call: the run that re-executes it knows that the
    call's `tool.started` is committed already (executor.resumed_waits)."""
    return interrupt({"kind": kind, "targets": [str(t) for t in targets], "cursor": cursor,
                      "timeout_s": timeout, "call_id": ctx.call_id})


async def wait_sessions(ctx: ToolContext, args: dict[str, Any]) -> Any:
    refs = args.get("sessions")
    if not isinstance(refs, list) or not refs:
        raise ToolError("invalid_arguments", "sessions must be a non-empty list")
    timeout = _timeout(args)
    _one_wait_per_step(ctx)
    async with ctx.pool.connection() as conn:
        targets = [await _resolve(conn, ctx, ref) for ref in refs]
    ids = list(dict.fromkeys(t["id"] for t in targets))
    if ctx.run["session_id"] in ids:
        raise ToolError("wait_on_self", "a session cannot wait on itself")
    cursor = {str(i): ctx.cursors.get(str(i), 0) for i in ids}

    async def updates() -> list[dict[str, Any]]:
        async with ctx.pool.connection() as conn:
            return await db.fetch_all(conn, "session_updates", {
                "waiter": ctx.run["session_id"], "targets": ids, "cursor": Jsonb(cursor)})

    found = await updates()
    timed_out = False
    if not found:
        resumed = await _suspend_or_answer(ctx, "sessions", ids, cursor, timeout)
        if resumed.get("reason") == "cycle":
            raise ToolError("wait_cycle", "waiting on these sessions would close a cycle of "
                            "sessions waiting on each other")
        found = await updates()
        timed_out = not found and resumed.get("reason") == "timeout"
    moved = dict(cursor)
    for row in found:
        moved[str(row["session_id"])] = max(moved[str(row["session_id"])], row["seq"])
    result = {
        "updates": [{"session_id": str(r["session_id"]), "path": r["path"],
                     "type": "message" if r["type"] == "message.sent" else r["type"],
                     "turn_id": str(r["turn_id"]) if r["turn_id"] else None,
                     "message_id": r["data"].get("message_id"), "seq": r["seq"]}
                    for r in found],
        "cursor": moved,
        "timed_out": timed_out,
    }
    return ToolOutput(result, cursors=moved)


async def wait_inputs(ctx: ToolContext, args: dict[str, Any]) -> Any:
    raw = args.get("input_ids")
    if not isinstance(raw, list) or not raw:
        raise ToolError("invalid_arguments", "input_ids must be a non-empty list")
    ids = list(dict.fromkeys(_uuid(i, "input_ids") for i in raw))
    timeout = _timeout(args)
    _one_wait_per_step(ctx)

    async def state() -> list[dict[str, Any]]:
        async with ctx.pool.connection() as conn:
            rows = await db.fetch_all(conn, "inputs_state", {**_scope(ctx).params(), "ids": ids})
        if len(rows) != len(ids):
            missing = sorted(set(map(str, ids)) - {str(r["input_id"]) for r in rows})
            raise ToolError("not_found", f"no input {', '.join(missing)} in this scope")
        return rows

    def terminal(rows) -> bool:
        return all(r["status"] in ("completed", "failed", "cancelled") for r in rows)

    rows = await state()
    if not terminal(rows):
        await _suspend_or_answer(ctx, "inputs", ids, {}, timeout)
        rows = await state()
    done = [r for r in rows if r["status"] in ("completed", "failed", "cancelled")]
    return {"inputs": [{"input_id": str(r["input_id"]), "status": r["status"],
                        "turn_id": str(r["turn_id"]) if r["turn_id"] else None} for r in done],
            "timed_out": len(done) < len(ids)}


async def list_sessions(ctx: ToolContext, args: dict[str, Any]) -> Any:
    scope = args.get("scope", "tree")
    if scope not in ("tree", "children"):
        raise ToolError("invalid_arguments", "scope must be tree or children")
    limit = args.get("limit", 50)
    if not isinstance(limit, int) or not 1 <= limit <= 200:
        raise ToolError("invalid_arguments", "limit must be an integer from 1 to 200")
    after = args.get("cursor") or ""
    async with ctx.pool.connection() as conn:
        rows = await db.fetch_all(conn, "tree_sessions", {
            **_scope(ctx).params(), "tree_id": ctx.run["tree_id"],
            "parent": ctx.run["session_id"] if scope == "children" else None,
            "after": str(after), "limit": limit + 1})
        slots = await db.fetch_one(conn, "tree_slots", {"tree_id": ctx.run["tree_id"]})
    page = rows[:limit]
    return {"sessions": [{"session_id": str(r["id"]), "path": r["path"], "title": r["title"],
                          "status": r["status"],
                          "current_turn_id": str(r["current_turn_id"])
                          if r["current_turn_id"] else None,
                          "queue": {"length": r["queue_length"], "paused": r["queue_paused"]}}
                         for r in page],
            "next_cursor": page[-1]["path"] if len(rows) > limit else None,
            "free_slots": slots["free"]}


async def get_result(ctx: ToolContext, args: dict[str, Any]) -> Any:
    ref = args.get("input_id") or args.get("turn_id")
    target = _uuid(ref, "input_id or turn_id")
    async with ctx.pool.connection() as conn:
        row = await db.fetch_one(conn, "turn_of_input_or_turn",
                                 {**_scope(ctx).params(), "id": target})
    if row is None:
        raise ToolError("not_found", f"no input or turn {target} in this scope")
    result = await sessions.get_result(ctx.pool, _scope(ctx), row["id"])
    return msgspec.to_builtins(result)


for _name, _fn, _waits, _effect_tool in [
    ("create_session", create_session, False, True),
    ("send_message", send_message, False, True),
    ("submit_input", submit_input, False, True), ("cancel_turn", cancel_turn, False, True),
    ("wait_sessions", wait_sessions, True, False), ("list_sessions", list_sessions, False, False),
    ("wait_inputs", wait_inputs, True, False), ("get_result", get_result, False, False),
]:
    register(_name, Tool(_fn, waits=_waits, side_effect=_effect_tool, schema=SCHEMAS[_name],
                         description=SCHEMAS[_name].get("description")
                         or (_fn.__doc__ or _name).strip().splitlines()[0]))

COOPERATION_TOOLS = tuple(SCHEMAS)
