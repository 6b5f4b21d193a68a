"""The agent graph: a model node and one `tool` task per tool call.

The model node's next step depends only on the checkpointed messages (the
turn's), the archived earlier turns (yuxi.conversation: written before the
turn's first checkpoint, never changed after) and the run's frozen config,
so a resumed or re-executed run behaves identically.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send

from yuxi.runtime.calls import CallPolicy, call_model as call_chat_model
from yuxi.runtime.tools import Tool, ToolContext, call_tool, tool_spec


def merge_cursors(old: dict[str, int] | None, new: dict[str, int] | None) -> dict[str, int]:
    """Consumption cursors only move forward."""
    merged = dict(old or {})
    for key, seq in (new or {}).items():
        merged[key] = max(seq, merged.get(key, 0))
    return merged


class AgentState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    # Per-target consumption cursors of wait_sessions, saved with the checkpoint.
    cursors: Annotated[dict[str, int], merge_cursors]


class ToolCallState(TypedDict):
    call: dict[str, Any]
    cursors: dict[str, int]
    waits_in_step: int


class Inbox(Protocol):
    """Input that reaches a running turn at its next safe boundary (steers)."""

    async def take(self, messages: list[AnyMessage]) -> list[AnyMessage]:
        """Messages received for this turn that `messages` does not hold yet."""
        ...


class NoInbox:
    async def take(self, messages: list[AnyMessage]) -> list[AnyMessage]:
        return []


class RunReporter(Protocol):
    """Receives what the graph does, to record it as events."""

    async def message(self, message: AIMessage) -> None: ...
    async def tool_started(self, call: dict[str, Any]) -> None: ...
    async def tool_finished(self, call: dict[str, Any], result: str) -> None: ...
    # Optional: text deltas while the model streams, token usage of a call,
    # the calls a resume re-executes whose start is recorded already.
    # async def delta(self, message_id: str, text: str) -> None: ...
    # async def usage(self, prompt_tokens: int, completion_tokens: int) -> None: ...
    # def started_before(self, call_ids: list[str]) -> None: ...


def tool_message_id(call_id: str) -> str:
    # Fixed ids: an uncommitted ToolMessage without one gets a new random id on
    # every read, and a replayed call must replace, never duplicate.
    return f"tool:{call_id}"


class RunDeps:
    """What the nodes of one run use: its bound model, tools, reporter,
    preamble, inbox and hooks. The topology is compiled once per process
    (`_topology`); a run's graph is that compiled graph with its checkpointer
    and these in its config (a copy costs ~0.04 ms, a compile ~1.6 ms)."""

    __slots__ = ("bound", "tools", "reporter", "preamble", "history", "inbox", "tool_context",
                 "policy", "in_flight", "on_delta", "on_usage")

    def __init__(self, **deps: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, deps[name])


# The run's RunDeps in the graph's config (an object: never written into a
# checkpoint's metadata, which keeps only strings and numbers).
DEPS = "yuxi_run"


def _deps(config: RunnableConfig) -> RunDeps:
    return config["configurable"][DEPS]


async def _call_model(state: AgentState, config: RunnableConfig) -> dict[str, Any]:
    run = _deps(config)
    # The inbox is the model boundary: it also stops a cancelled turn.
    arrived = await run.inbox.take(state["messages"])
    # The checkpoint holds the messages since the turn started; the turns
    # before it come from the archive (`history`, loaded once per run).
    call = call_chat_model(run.bound, [*run.preamble, *run.history, *state["messages"], *arrived],
                           run.policy, run.on_delta)
    # `in_flight` lets a cancel notification abort the call (and its HTTP
    # request) at once instead of at the next boundary.
    answer = await (run.in_flight(call) if run.in_flight else call)
    usage = answer.usage_metadata
    if usage and run.on_usage is not None:
        await run.on_usage(int(usage.get("input_tokens") or 0),
                           int(usage.get("output_tokens") or 0))
    await run.reporter.message(answer)
    return {"messages": [*arrived, answer]}


async def _route(state: AgentState, config: RunnableConfig) -> Any:
    # A coroutine: LangGraph runs a plain function of a conditional edge in a
    # thread pool, a hop to a thread and back (two wake-ups) at every step.
    tools = _deps(config).tools
    last = state["messages"][-1]
    if isinstance(last, AIMessage) and last.tool_calls:
        waits = sum(1 for c in last.tool_calls if c["name"] in tools and tools[c["name"]].waits)
        cursors = state.get("cursors") or {}
        return [Send("tool", {"call": call, "cursors": cursors, "waits_in_step": waits})
                for call in last.tool_calls]
    return END


async def _run_tool(state: ToolCallState, config: RunnableConfig) -> dict[str, Any]:
    run = _deps(config)
    call = state["call"]
    # The reporter's tool_started also stops a cancelled turn (before each
    # tool call: the executor's reporter checks the intent in that statement).
    await run.reporter.tool_started(call)
    ctx = run.tool_context(call["id"], state.get("cursors") or {},
                           state.get("waits_in_step", 0)) if run.tool_context else None
    result, cursors = await call_tool(run.tools, ctx, call["name"], call.get("args") or {})
    await run.reporter.tool_finished(call, result)
    message = ToolMessage(
        content=result, tool_call_id=call["id"], name=call["name"],
        id=tool_message_id(call["id"]),
    )
    return {"messages": [message], "cursors": cursors} if cursors else {"messages": [message]}


@functools.cache
def _topology():
    """The graph's structure, compiled once per process."""
    graph = StateGraph(AgentState)
    graph.add_node("model", _call_model)
    graph.add_node("tool", _run_tool)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", _route, ["tool", END])
    graph.add_edge("tool", "model")
    return graph.compile()


def build_graph(
    model: BaseChatModel,
    tools: dict[str, Tool],
    reporter: RunReporter,
    *,
    preamble: list[SystemMessage],
    history: list[AnyMessage] = (),
    checkpointer: BaseCheckpointSaver | None,
    inbox: Inbox | None = None,
    tool_context: Callable[..., ToolContext] | None = None,
    policy: CallPolicy | None = None,
    in_flight: Callable[[Awaitable[Any]], Awaitable[Any]] | None = None,
):
    """The graph of one run. `preamble` (identity, system prompt) is
    prepended to every model call and never stored in the conversation.
    `history` (the archived turns: yuxi.services.conversation) comes after
    it; the run sets it with `set_history` once it is loaded.

    Before each model call (the safe boundary: never inside a tool batch) the
    inbox's new messages join the conversation; they are checkpointed with the
    model's answer, so a re-executed step takes them in again by id, never twice.
    """
    deps = RunDeps(
        bound=model.bind_tools([tool_spec(n, t) for n, t in tools.items()]) if tools else model,
        tools=tools, reporter=reporter, preamble=preamble, history=list(history),
        inbox=inbox or NoInbox(),
        tool_context=tool_context, policy=policy or CallPolicy(),
        in_flight=in_flight, on_delta=getattr(reporter, "delta", None),
        on_usage=getattr(reporter, "usage", None))
    return _topology().copy(update={"checkpointer": checkpointer}).with_config(
        configurable={DEPS: deps})


def started_before(graph: Any, call_ids: list[str]) -> None:
    """Tell the run's reporter (if it cares) that these calls, which the
    graph is about to re-execute, recorded their start before."""
    mark = getattr(_deps(graph.config).reporter, "started_before", None)
    if mark is not None and call_ids:
        mark(call_ids)


def set_history(graph: Any, history: list[AnyMessage]) -> None:
    """Give a run's graph the archived conversation its model calls see
    between the preamble and the checkpoint's messages."""
    graph.config["configurable"][DEPS].history = history
