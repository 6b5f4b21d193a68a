"""Tools a model can call. Each tool call runs as its own graph task, so the
results of finished calls are saved as pending writes when another suspends.

A tool returns a JSON-serializable value; a refused or failing call becomes a
structured error result for the model (`{"error": {"code", "message"}}`) and
never crashes the run. Side-effecting tools write through SQL functions that
are fenced by the run's lease and check the user's grant when they execute.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from langgraph.errors import GraphBubbleUp
from langgraph.types import interrupt
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.errors import LeaseLost, YuxiError, is_connection_error
from yuxi.services.resources import Resolved


class ToolContext(msgspec.Struct, frozen=True):
    """What a tool call may use: the run it belongs to (its row from
    start_run and its lease), the resources resolved visible when the run
    started, and the conversation state tools may read (wait cursors)."""

    pool: AsyncConnectionPool
    run_id: uuid.UUID
    token: uuid.UUID
    call_id: str
    visible: tuple[Resolved, ...] = ()
    run: dict[str, Any] = {}
    cursors: dict[str, int] = {}
    # Wait tools called by the same model message (one wait per step).
    waits_in_step: int = 0
    default_model: str = "replay"
    # The tree's workdir and sandbox (yuxi.services.sandbox.Sandbox), when
    # the run has sandbox tools.
    sandbox: Any = None
    # The run's batched create_session calls (yuxi.runtime.cooperation.create_batch).
    creates: Any = None

    def visible_resource(self, kind: str, name: str) -> uuid.UUID:
        for r in self.visible:
            if (r.kind, r.name) == (kind, name) and r.granted:
                return r.resource_id  # type: ignore[return-value]
        raise ToolError("permission_denied", f"{kind}:{name} is not visible to this run")


ToolFn = Callable[[ToolContext, dict[str, Any]], Awaitable[Any]]


class ToolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ToolOutput(msgspec.Struct, frozen=True):
    """A tool result plus state the tool updates (wait cursors)."""

    result: Any
    cursors: dict[str, int] = {}


class Tool(msgspec.Struct, frozen=True):
    fn: ToolFn
    # The tool group whose grant the tool needs (None: always available).
    group: str | None = None
    # Tools that suspend the run until something happens (one per step).
    waits: bool = False
    # Side-effecting tools ask their user first in approval mode "confirm".
    side_effect: bool = False
    # What a model is offered: a description and the JSON schema of the
    # arguments (an object schema: properties, required).
    description: str = ""
    schema: dict[str, Any] = {}


def tool_spec(name: str, tool: Tool) -> dict[str, Any]:
    """The OpenAI function-tool form of a tool, offered to real models."""
    schema = tool.schema or {}
    parameters: dict[str, Any] = {"type": "object",
                                  "properties": schema.get("properties", {}),
                                  "additionalProperties": False}
    if schema.get("required"):
        parameters["required"] = list(schema["required"])
    return {"type": "function",
            "function": {"name": name,
                         "description": tool.description or schema.get("description")
                         or (tool.fn.__doc__ or name).strip().splitlines()[0],
                         "parameters": parameters}}


async def _echo(ctx: ToolContext, args: dict[str, Any]) -> Any:
    """Return the given text: a harmless tool for demos and tests."""
    return {"text": str(args.get("text", ""))}


async def _add_note(ctx: ToolContext, args: dict[str, Any]) -> Any:
    """Write a note into a collection (side effect: re-checks the grants)."""
    collection, text = str(args.get("collection", "")), str(args.get("text", ""))
    ctx.visible_resource("collection", collection)
    async with ctx.pool.connection() as conn:
        with db.domain_errors():
            row = await db.fetch_one(conn, "add_note", {
                "run_id": ctx.run_id, "token": ctx.token, "call_id": ctx.call_id,
                "collection": collection, "content": text})
    return {"note_id": str(row["id"]), "collection": collection}


async def _search_notes(ctx: ToolContext, args: dict[str, Any]) -> Any:
    """Notes of a visible collection containing the query."""
    resource = ctx.visible_resource("collection", str(args.get("collection", "")))
    async with ctx.pool.connection() as conn:
        rows = await db.fetch_all(conn, "search_notes",
                                  {"resource_id": resource, "query": str(args.get("query", ""))})
    return {"notes": [r["content"] for r in rows]}


BUILTIN_TOOLS: dict[str, Tool] = {
    "echo": Tool(_echo, description="Return the given text.",
                 schema={"properties": {"text": {"type": "string"}}, "required": ["text"]}),
    "add_note": Tool(_add_note, group="notes", side_effect=True,
                     description="Write a note into a collection.",
                     schema={"properties": {"collection": {"type": "string"},
                                            "text": {"type": "string"}},
                             "required": ["collection", "text"]}),
    "search_notes": Tool(_search_notes, group="notes",
                         description="Notes of a visible collection containing the query.",
                         schema={"properties": {"collection": {"type": "string"},
                                                "query": {"type": "string"}},
                                 "required": ["collection", "query"]}),
}


def register(name: str, tool: Tool) -> None:
    BUILTIN_TOOLS[name] = tool


def available_tools(selected: list[str], visible: list[Resolved]) -> dict[str, Tool]:
    """The selected builtin tools whose group (if any) is visible to the run."""
    groups = {r.name for r in visible if r.kind == "tool_group" and r.granted}
    return {name: BUILTIN_TOOLS[name] for name in selected
            if name in BUILTIN_TOOLS and BUILTIN_TOOLS[name].group in (None, *groups)}


def _approval(tool: Tool, ctx: ToolContext | None, name: str,
              args: dict[str, Any]) -> dict[str, Any] | None:
    """In approval mode "confirm" a side-effecting call first asks the user
    (the run suspends; the answer resumes it here). Returns the result of a
    rejected call, None when the call may run."""
    if not tool.side_effect or ctx is None or \
            ctx.run.get("config", {}).get("approval_mode") != "confirm":
        return None
    decision = interrupt({"kind": "approval", "call_id": ctx.call_id, "tool": name,
                          "args": args})
    if isinstance(decision, dict) and decision.get("approve") is True:
        return None
    message = decision.get("message") if isinstance(decision, dict) else None
    return error_result("rejected_by_user", message or f"the user rejected this {name} call")


def error_result(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


async def call_tool(tools: dict[str, Tool], ctx: ToolContext, name: str,
                    args: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """Run one tool call: its result as JSON text, and cursor updates."""
    tool = tools.get(name)
    cursors: dict[str, int] = {}
    if tool is None:
        result: Any = error_result("unknown_tool", f"no tool named {name!r} is available")
    elif not isinstance(args, dict):
        result = error_result("invalid_arguments", "tool arguments must be an object")
    elif (rejected := _approval(tool, ctx, name, args)) is not None:
        result = rejected
    else:
        try:
            result = await tool.fn(ctx, args)
            if isinstance(result, ToolOutput):
                result, cursors = result.result, result.cursors
        except GraphBubbleUp:  # interrupt(): the run suspends here
            raise
        except ToolError as exc:
            result = error_result(exc.code, exc.message)
        except LeaseLost:
            raise
        except Exception as exc:
            if is_connection_error(exc):
                raise  # the database is away: an infrastructure fault of the run
            if isinstance(exc, YuxiError):
                result = error_result(exc.code, exc.message)
            else:  # a failing tool is the model's problem to handle
                result = error_result("tool_failed", f"{type(exc).__name__}: {exc}")
    return msgspec.json.encode(result).decode(), cursors
