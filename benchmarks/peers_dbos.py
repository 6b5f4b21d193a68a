"""The peer system of `make bench-peers`: the same one-node LangGraph graph
(yuxi.runtime.graph.build_graph, the replay model, an AsyncPostgresSaver
checkpointer, thread_id = the session's id) run by DBOS Transact 3.4 as a
workflow on a DBOS queue (global concurrency 4, polling every 0.05 s),
behind a small HTTP app:

    POST /turns {"session_id", "text"}  -> 202 {"id": <workflow id>} (enqueued)
    GET  /turns/{id}/result             -> 200 {"text": ...} (polls the workflow's
                                           status every 0.05 s until it ended)

Run by benchmarks.peers as `uvicorn --factory benchmarks.peers_dbos:create_app`
with PEERS_DBOS_DATABASE_URL naming its own database (DBOS's system tables in
schema `dbos`, the checkpoints in schema `langgraph`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

from dbos import DBOS, DBOSConfig
from litestar import Litestar, get, post
from litestar.status_codes import HTTP_202_ACCEPTED

from benchmarks.run import NoopReporter

URL = os.environ.get("PEERS_DBOS_DATABASE_URL", "")
QUEUE = "turns"
AGENT_CONFIG: dict[str, Any] = {"model": "replay",
                                "replay": {"default": [{"say": "ok {{ input }}"}]}}

DBOS(config=DBOSConfig(name="yuxi-peers", system_database_url=URL, log_level="WARNING"))

_pools: dict[int, Any] = {}


async def _checkpoint_pool() -> Any:
    """One pool per event loop (DBOS runs queued async workflows on a loop
    of its own), like the worker's checkpoint pool."""
    from yuxi import db

    loop = id(asyncio.get_running_loop())
    if loop not in _pools:
        pool = db.checkpoint_pool(URL, min_size=4, max_size=8)
        await pool.open(wait=True)
        _pools[loop] = pool
    return _pools[loop]


@DBOS.step()
async def run_graph(session_id: str, text: str) -> str:
    """The turn's graph run: what Yuxi's worker runs (benchmarks.run's
    DirectGraph: same model, same preamble, same turn marker)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    from yuxi.runtime.graph import build_graph
    from yuxi.runtime.models import build_chat_model
    from yuxi.services.sessions import CONFIG_DEFAULTS

    config = {**CONFIG_DEFAULTS, **AGENT_CONFIG}
    run_id = str(uuid.uuid4())
    session = {"id": session_id, "name": "root", "path": "/root", "parent_id": None,
               "tree_id": session_id}
    model = build_chat_model(config["model"], config, approval_mode=config["approval_mode"],
                             session=session)
    preamble = [SystemMessage(
        content=(f"You are Yuxi session 'root' at path /root (session id {session_id}, "
                 f"parent none (root session), tree {session_id}, run {run_id})."),
        id=f"identity:{run_id}")]
    graph = build_graph(model, {}, NoopReporter(), preamble=preamble,
                        checkpointer=AsyncPostgresSaver(await _checkpoint_pool()))
    out = await graph.ainvoke(
        {"messages": [HumanMessage(content=text, id=f"input:{uuid.uuid4()}",
                                   additional_kwargs={"yuxi": {"turn_start": True}})]},
        {"configurable": {"thread_id": session_id},
         "recursion_limit": 2 * int(config["max_steps"]) + 2},
        durability="sync")
    last = out["messages"][-1]
    if not isinstance(last, AIMessage):
        raise RuntimeError(f"unexpected answer {last!r}")
    return last.text


@DBOS.workflow()
async def turn(session_id: str, text: str) -> dict[str, str]:
    return {"text": await run_graph(session_id, text)}


@post("/turns", status_code=HTTP_202_ACCEPTED)
async def post_turn(data: dict[str, str]) -> dict[str, str]:
    queue = await DBOS.retrieve_queue_async(QUEUE)
    handle = await queue.enqueue_async(turn, data["session_id"], data["text"])
    return {"id": handle.get_workflow_id()}


@get("/turns/{workflow_id:str}/result")
async def turn_result(workflow_id: str) -> dict[str, str]:
    handle = await DBOS.retrieve_workflow_async(workflow_id)
    # DBOS polls the workflow's status for its result (every 1 s by
    # default): poll as often as the queue is.
    return await handle.get_result(polling_interval_sec=0.05)


@get("/readyz")
async def readyz() -> dict[str, str]:
    return {"status": "ok"}


async def _startup() -> None:
    await asyncio.to_thread(DBOS.launch)
    await DBOS.register_queue_async(QUEUE, global_concurrency=4, polling_interval_sec=0.05,
                                    on_conflict="always_update")


async def _shutdown() -> None:
    await asyncio.to_thread(DBOS.destroy)


def create_app() -> Litestar:
    return Litestar([post_turn, turn_result, readyz], on_startup=[_startup],
                    on_shutdown=[_shutdown])
