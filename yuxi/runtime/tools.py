"""Tools a model can call. Each tool call runs as its own graph task, so the
results of finished calls are saved as pending writes when another suspends.

A tool returns a JSON-serializable value; a refused or failing call becomes a
structured error result for the model (`{"error": {"code", "message"}}`) and
never crashes the run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from yuxi.errors import LeaseLost

ToolFn = Callable[[dict[str, Any]], Awaitable[Any]]


class ToolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _echo(args: dict[str, Any]) -> Any:
    """Return the given text: a harmless tool for demos and tests."""
    return {"text": str(args.get("text", ""))}


BUILTIN_TOOLS: dict[str, ToolFn] = {"echo": _echo}


def error_result(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


async def call_tool(tools: dict[str, ToolFn], name: str, args: dict[str, Any]) -> str:
    """Run one tool call and return its result as JSON text."""
    fn = tools.get(name)
    if fn is None:
        result: Any = error_result("unknown_tool", f"no tool named {name!r}")
    else:
        try:
            result = await fn(args)
        except ToolError as exc:
            result = error_result(exc.code, exc.message)
        except LeaseLost:
            raise
        except Exception as exc:  # a failing tool is the model's problem to handle
            result = error_result("tool_failed", f"{type(exc).__name__}: {exc}")
    return msgspec.json.encode(result).decode()
