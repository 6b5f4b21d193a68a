"""The agent graph's topology is compiled once per process; each run's
model, tools and reporter travel in its own config, so runs sharing the
compiled graph never see each other's."""

from __future__ import annotations

import asyncio

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from yuxi.runtime import graph as agent_graph


class Recorder:
    def __init__(self) -> None:
        self.said: list[str] = []

    async def message(self, message) -> None:
        await asyncio.sleep(0.01)  # interleave the two runs
        self.said.append(message.content)

    async def tool_started(self, call) -> None: ...
    async def tool_finished(self, call, result) -> None: ...


async def test_runs_share_the_compiled_topology_and_keep_their_own_dependencies():
    saver = InMemorySaver()
    runs = []
    for name in ("a", "b"):
        reporter = Recorder()
        g = agent_graph.build_graph(FakeListChatModel(responses=[f"answer {name}"]), {},
                                    reporter, preamble=[], checkpointer=saver)
        runs.append((name, g, reporter))
    assert runs[0][1].nodes["model"] is runs[1][1].nodes["model"]  # one compiled structure
    results = await asyncio.gather(*(
        g.ainvoke({"messages": [HumanMessage(content=name)]},
                  {"configurable": {"thread_id": name}}) for name, g, _ in runs))
    assert [r["messages"][-1].content for r in results] == ["answer a", "answer b"]
    assert [rep.said for _, _, rep in runs] == [["answer a"], ["answer b"]]
    assert agent_graph._topology.cache_info().currsize == 1


def _threaded(monkeypatch) -> list[str]:
    """What is handed to a thread pool (LangGraph runs plain functions of
    its steps there)."""
    import concurrent.futures

    handed: list[str] = []
    original = concurrent.futures.ThreadPoolExecutor.submit

    def submit(self, fn, *args, **kwargs):
        handed.append(getattr(fn, "__name__", repr(fn)))
        return original(self, fn, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    return handed


async def _one_step() -> None:
    g = agent_graph.build_graph(FakeListChatModel(responses=["ok"]), {}, Recorder(),
                                preamble=[], checkpointer=None)
    await g.ainvoke({"messages": [HumanMessage(content="q")]})


async def test_a_step_runs_in_the_event_loop_without_a_thread_hop(monkeypatch):
    # The route after the model is a coroutine: a plain function would be
    # run in a thread, a hop there and back at every step.
    handed = _threaded(monkeypatch)
    await _one_step()
    assert handed == []


async def test_a_plain_route_function_is_run_in_a_thread(monkeypatch):
    # Negative case: the same topology with a plain routing function.
    route = agent_graph._route

    def sync_route(state, config):
        last = state["messages"][-1]
        return agent_graph.END if not getattr(last, "tool_calls", None) else "tool"

    monkeypatch.setattr(agent_graph, "_route", sync_route)
    agent_graph._topology.cache_clear()
    try:
        handed = _threaded(monkeypatch)
        await _one_step()
        assert handed != []
    finally:
        monkeypatch.setattr(agent_graph, "_route", route)
        agent_graph._topology.cache_clear()
