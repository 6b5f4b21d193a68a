"""Request bodies (one msgspec Struct per use). Unknown fields are refused so
a typo is a 422 naming the field, never silently ignored."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec

NonBlank = Annotated[str, msgspec.Meta(min_length=1, pattern=r"\S")]
ApprovalMode = Literal["auto", "confirm"]


class AgentCreate(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"\S")]
    config: dict[str, Any]


class SessionCreate(msgspec.Struct, forbid_unknown_fields=True):
    agent_id: uuid.UUID
    title: Annotated[str, msgspec.Meta(max_length=500)] | None = None
    model: NonBlank | None = None
    approval_mode: ApprovalMode | None = None


class SessionUpdate(msgspec.Struct, forbid_unknown_fields=True):
    # UNSET = omitted (unchanged); an explicit null fails validation (422).
    title: Annotated[str, msgspec.Meta(max_length=500)] | msgspec.UnsetType = msgspec.UNSET
    model: NonBlank | msgspec.UnsetType = msgspec.UNSET
    approval_mode: ApprovalMode | msgspec.UnsetType = msgspec.UNSET

    def changes(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__
                if getattr(self, f) is not msgspec.UNSET}


class InputCreate(msgspec.Struct, forbid_unknown_fields=True):
    content: Annotated[str, msgspec.Meta(min_length=1, max_length=200_000, pattern=r"\S")]
    mode: Literal["steer", "queue"] = "steer"
    model: NonBlank | None = None
    approval_mode: ApprovalMode | None = None
    client_request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200,
                                                    pattern=r"\S")] | None = None


class Decision(msgspec.Struct, forbid_unknown_fields=True):
    call_id: str
    approve: bool
    message: str | None = None


class TurnAnswer(msgspec.Struct, forbid_unknown_fields=True):
    decisions: list[Decision] | None = None
    answers: dict[str, str | list[str]] | None = None


class Page(msgspec.Struct):
    items: list[Any]
    next_cursor: str | None
