"""The conversation of a session, read from its LangGraph checkpoint."""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg_pool import AsyncConnectionPool


def message_json(message: BaseMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"id": message.id, "role": message.type, "content": message.content}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [{"id": c["id"], "name": c["name"], "args": c["args"]}
                             for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        out["name"] = message.name
    return out


async def messages(checkpoint_pool: AsyncConnectionPool, session_id: uuid.UUID) -> list[dict]:
    """The committed conversation (the latest checkpoint, without pending
    writes of a step in progress)."""
    saver = AsyncPostgresSaver(checkpoint_pool)
    found = await saver.aget_tuple(
        {"configurable": {"thread_id": str(session_id), "checkpoint_ns": ""}})
    if found is None:
        return []
    return [message_json(m) for m in found.checkpoint["channel_values"].get("messages", [])]
