"""Agents, sessions, inputs and turns."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

import msgspec

from yuxi.api.schemas import (AgentCreate, InputCreate, Page, SessionCreate, SessionUpdate,
                              TurnAnswer)
from yuxi.api.auth import Caller
from yuxi.errors import InvalidRequest
from yuxi.domain import Agent, Input, Receipt, Session, Turn, TurnResult
from yuxi.runtime.models import list_models
from yuxi.services import accounts, conversation, sessions

# `?wait=<seconds>` of the blocking reads: up to 60.
WaitSeconds = Annotated[float | None, QueryParameter(ge=0, le=60)]


def _pool(request: Request):
    return request.app.state.pool


class AgentController(Controller):
    path = "/api/agents"
    tags = ["agents"]

    @post("/", operation_id="createAgent", status_code=201)
    async def create_agent(self, request: Request, caller: Caller, data: JSONBody[AgentCreate]) -> Agent:
        return await accounts.create_agent(_pool(request), caller, data.name, data.config)

    @get("/", operation_id="listAgents")
    async def list_agents(self, request: Request, caller: Caller) -> list[Agent]:
        return await accounts.list_agents(_pool(request), caller)


class SessionController(Controller):
    path = "/api/sessions"
    tags = ["sessions"]

    @post("/", operation_id="createSession", status_code=201)
    async def create_session(self, request: Request, caller: Caller, data: JSONBody[SessionCreate]) -> Session:
        return await sessions.create_session(
            _pool(request), caller, agent_id=data.agent_id,
            default_model=request.app.state.settings.default_model,
            title=data.title, model=data.model, approval_mode=data.approval_mode,
        )

    @get("/", operation_id="listSessions")
    async def list_sessions(
        self, request: Request, caller: Caller,
        limit: Annotated[int, QueryParameter(ge=1, le=200)] = 50,
        cursor: FromQuery[str | None] = None,
    ) -> Page:
        items, next_cursor = await sessions.list_sessions(
            _pool(request), caller, limit=limit, cursor=cursor)
        return Page(items=items, next_cursor=next_cursor)

    @get("/{session_id:uuid}", operation_id="getSession")
    async def get_session(self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID]) -> Session:
        session = await sessions.get_session(_pool(request), caller, session_id)
        usage = await sessions.session_usage(_pool(request), caller, session_id)
        return msgspec.structs.replace(session, usage=usage)

    @post("/{session_id:uuid}", operation_id="updateSession", status_code=200)
    async def update_session(
        self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID], data: JSONBody[SessionUpdate]
    ) -> Session:
        return await sessions.update_session(_pool(request), caller, session_id, data.changes())

    @post("/{session_id:uuid}/inputs", operation_id="createInput", status_code=202)
    async def create_input(
        self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID], data: JSONBody[InputCreate],
        wait: WaitSeconds = None,
    ) -> Receipt:
        limit = request.app.state.settings.max_content_chars
        if len(data.content) > limit:
            raise InvalidRequest(
                f"content is longer than {limit} characters",
                errors=[{"field": "content", "message": f"at most {limit} characters"}])
        receipt = await sessions.receive_input(
            _pool(request), caller, session_id, content=data.content, mode=data.mode,
            model=data.model, approval_mode=data.approval_mode,
            client_request_id=data.client_request_id, by_user=True,
        )
        if wait is None or receipt.turn_id is None:
            return receipt
        result = await sessions.wait_result(_pool(request), request.app.state.hub, caller,
                                            receipt.turn_id, wait)
        return msgspec.structs.replace(receipt, result=result)

    @post("/{session_id:uuid}/stop", operation_id="stopTree", status_code=202)
    async def stop(self, request: Request, caller: Caller,
                   session_id: FromPath[uuid.UUID]) -> dict[str, int]:
        return {"turns": await sessions.stop_tree(_pool(request), caller, session_id)}

    @post("/{session_id:uuid}/queue/continue", operation_id="continueQueue", status_code=200)
    async def continue_queue(self, request: Request, caller: Caller,
                             session_id: FromPath[uuid.UUID]) -> Session:
        return await sessions.continue_queue(_pool(request), caller, session_id)

    @get("/{session_id:uuid}/tree", operation_id="getSessionTree")
    async def get_tree(
        self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID]
    ) -> dict[str, Any]:
        members = await sessions.get_tree(_pool(request), caller, session_id)
        tree_id = members[0]["id"] if members else None
        slots = await sessions.tree_slot_use(_pool(request), tree_id) if tree_id else None
        usage = await sessions.tree_usage(_pool(request), caller, tree_id) if tree_id else None
        return {"tree_id": tree_id, "sessions": members, "slots": slots, "usage": usage}

    @get("/{session_id:uuid}/turns", operation_id="listTurns")
    async def list_turns(self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID]) -> list[Turn]:
        return await sessions.list_turns(_pool(request), caller, session_id)

    @get("/{session_id:uuid}/messages", operation_id="listMessages")
    async def list_messages(
        self, request: Request, caller: Caller, session_id: FromPath[uuid.UUID],
        limit: Annotated[int, QueryParameter(
            ge=1, le=conversation.MAX_LIMIT,
            description="How many messages, at most (the newest before `before`).")
        ] = conversation.DEFAULT_LIMIT,
        before: Annotated[int | None, QueryParameter(
            ge=1, le=conversation.END,
            description="Only messages whose `position` is smaller: the `position` of "
                        "the first message of the page before, for the next older page.")
        ] = None,
    ) -> list[dict[str, Any]]:
        """The conversation, oldest first, each message with its `position`
        (1, 2, ... in the session): the newest `limit` messages, or those
        before `before`. A page whose first position is above 1 has older
        messages: ask again with `before` = that position."""
        await sessions.get_session(_pool(request), caller, session_id)
        return await conversation.messages(request.app.state.checkpoint_pool, session_id,
                                           limit=limit, before=before)


class InputController(Controller):
    path = "/api/inputs"
    tags = ["inputs"]

    @get("/{input_id:uuid}", operation_id="getInput")
    async def get_input(self, request: Request, caller: Caller, input_id: FromPath[uuid.UUID]) -> Input:
        return await sessions.get_input(_pool(request), caller, input_id)


class TurnController(Controller):
    path = "/api/turns"
    tags = ["turns"]

    @get("/{turn_id:uuid}", operation_id="getTurn")
    async def get_turn(self, request: Request, caller: Caller, turn_id: FromPath[uuid.UUID]) -> Turn:
        return await sessions.get_turn(_pool(request), caller, turn_id)

    @post("/{turn_id:uuid}/cancel", operation_id="cancelTurn", status_code=202)
    async def cancel_turn(self, request: Request, caller: Caller,
                          turn_id: FromPath[uuid.UUID]) -> Turn:
        return await sessions.cancel_turn(_pool(request), caller, turn_id)

    @post("/{turn_id:uuid}/answer", operation_id="answerTurn", status_code=202)
    async def answer(self, request: Request, caller: Caller, turn_id: FromPath[uuid.UUID],
                     data: JSONBody[TurnAnswer]) -> Turn:
        return await sessions.answer_turn(
            _pool(request), caller, turn_id,
            decisions=[msgspec.to_builtins(d) for d in data.decisions or []],
            answers=data.answers)

    @get("/{turn_id:uuid}/result", operation_id="getTurnResult")
    async def get_result(self, request: Request, caller: Caller, turn_id: FromPath[uuid.UUID],
                         wait: WaitSeconds = None) -> TurnResult:
        if wait is None:
            return await sessions.get_result(_pool(request), caller, turn_id)
        return await sessions.wait_result(_pool(request), request.app.state.hub, caller,
                                          turn_id, wait)


@get("/api/models", operation_id="listModels", tags=["models"])
async def models(caller: Caller) -> dict[str, Any]:
    """The models a caller can choose (replay and the configured providers')."""
    return {"items": list_models()}
