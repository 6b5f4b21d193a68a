"""Clean the checkpoint of a cancelling turn with the checkpoint-only graph:
the same topology, no model and no tool ever runs; only state updates.

Three commits, each safe to retry from the start after a crash (every step
checks whether it is still needed, from committed state):

1. `as_node=END`: merge the pending writes of tool calls that already
   finished and clear the waiting tasks (nothing finished is lost)
   (`merge_finished_writes`);
2. for every call of the current AI message that has no result, a
   cancellation ToolMessage whose id is derived from the AI message id and
   the call id (a retry replaces it, never duplicates it)
   (`answer_unpaired_calls`);
3. `as_node=END` again: clear the tasks step 2 triggered
   (`clear_triggered_tasks`).

Only then does the turn end `cancelled`, and the conversation is valid for
the next model call (every tool call paired).
"""

from __future__ import annotations

import uuid
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.runtime.graph import NoInbox, build_graph

CANCELLED_RESULT = "cancelled: the turn was cancelled before this tool call finished"


class _Silent:
    async def message(self, message: AIMessage) -> None: ...
    async def tool_started(self, call: dict[str, Any]) -> None: ...
    async def tool_finished(self, call: dict[str, Any], result: str) -> None: ...


def checkpoint_only_graph(checkpoint_pool: AsyncConnectionPool):
    # The model is never called (only aupdate_state is used); it exists so the
    # graph has the same nodes and edges as the one that wrote the checkpoint.
    return build_graph(FakeListChatModel(responses=[]), {}, _Silent(), preamble=[],
                       checkpointer=AsyncPostgresSaver(checkpoint_pool), inbox=NoInbox())


def unanswered_calls(messages: list[Any]) -> tuple[AIMessage | None, list[str]]:
    """The current AI message and its tool calls with no result after it."""
    for index in range(len(messages) - 1, -1, -1):
        if isinstance(messages[index], AIMessage):
            ai = messages[index]
            answered = {m.tool_call_id for m in messages[index + 1:] if isinstance(m, ToolMessage)}
            return ai, [c["id"] for c in ai.tool_calls if c["id"] not in answered]
    return None, []


async def merge_finished_writes(graph: Any, cfg: dict[str, Any], state: Any) -> bool:
    """Step 1 (and the merge any retry needs): `as_node=END` applies the
    pending writes of tool calls that finished and clears the waiting tasks.
    Returns whether it committed."""
    if not (state.next or any(t.writes for t in state.tasks)):
        return False
    await graph.aupdate_state(cfg, None, as_node=END)
    return True


async def answer_unpaired_calls(graph: Any, cfg: dict[str, Any], state: Any) -> bool:
    """Step 2: a cancellation ToolMessage for every call of the current AI
    message that has no result (fixed ids: a retry replaces, never adds)."""
    ai, missing = unanswered_calls(state.values.get("messages", []))
    if not missing:
        return False
    names = {c["id"]: c["name"] for c in ai.tool_calls}
    await graph.aupdate_state(cfg, {"messages": [
        ToolMessage(content=CANCELLED_RESULT, tool_call_id=call_id, name=names[call_id],
                    id=f"cancel:{ai.id}:{call_id}") for call_id in missing]},
        as_node="tool")
    return True


async def clear_triggered_tasks(graph: Any, cfg: dict[str, Any], state: Any) -> bool:
    """Step 3: `as_node=END` again clears the model task step 2 scheduled."""
    if not state.next:
        return False
    await graph.aupdate_state(cfg, None, as_node=END)
    return True


async def clean_checkpoint(checkpoint_pool: AsyncConnectionPool, session_id: uuid.UUID,
                           *, stop_after: int | None = None) -> int:
    """Run the cleanup steps still needed; returns how many commits it made.
    `stop_after` ends early after that many commits (to test crash points)."""
    graph = checkpoint_only_graph(checkpoint_pool)
    cfg = {"configurable": {"thread_id": str(session_id)}}
    state = await graph.aget_state(cfg)
    if not state.values:
        return 0  # no checkpoint: nothing ran
    # Looked up here, at each call: each step can be addressed on its own.
    steps = (merge_finished_writes, answer_unpaired_calls, clear_triggered_tasks)
    commits = 0
    for number, step in enumerate(steps, 1):
        if not await step(graph, cfg, state):
            continue
        commits += 1
        if number == len(steps) or (stop_after is not None and commits >= stop_after):
            break
        state = await graph.aget_state(cfg)
    return commits


async def clean_cancelled_turn(pool: AsyncConnectionPool, checkpoint_pool: AsyncConnectionPool,
                               turn_id: uuid.UUID) -> bool:
    """Clean a cancelling turn's checkpoint and end it cancelled. False when
    the turn is not cancelling (already done, or never was)."""
    async with pool.connection() as conn:
        turn = await db.fetch_one(conn, "cleanup_target", {"turn_id": turn_id})
    if turn is None or turn["status"] != "cancelling":
        return False
    await clean_checkpoint(checkpoint_pool, turn["session_id"])
    async with pool.connection() as conn:
        return bool((await db.fetch_one(conn, "finish_cancel", {"turn_id": turn_id}))["finished"])
