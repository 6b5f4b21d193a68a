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
