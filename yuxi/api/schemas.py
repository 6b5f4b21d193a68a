"""Request bodies (one msgspec Struct per use). Unknown fields are refused so
a typo is a 422 naming the field, never silently ignored.

No text of a body may hold a NUL character (U+0000): PostgreSQL text and
jsonb cannot store it, so it is refused with 422 naming the field, in every
string of a body, nested object keys and values included (`Body`)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec

NonBlank = Annotated[str, msgspec.Meta(min_length=1, pattern=r"\S")]
ApprovalMode = Literal["auto", "confirm"]

# The longest input content the schema admits; the configured limit
# (YUXI_MAX_CONTENT_CHARS, Settings.max_content_chars) is checked by the
# handler and may only be lower.
CONTENT_MAX_CHARS = 1_000_000


def _nul_path(value: Any, path: str) -> str | None:
    """The JSON path of the first string (or key) in `value` holding a NUL."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return path
            if (found := _nul_path(item, f"{path}.{key}")) is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if (found := _nul_path(item, f"{path}[{i}]")) is not None:
                return found
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            if (found := _nul_path(getattr(value, name), f"{path}.{name}")) is not None:
                return found
    return None


class Body(msgspec.Struct, forbid_unknown_fields=True):
    """A request body: no NUL character in any of its text."""

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if (path := _nul_path(getattr(self, name), f"$.{name}")) is not None:
                # msgspec reports it as a validation error (422), naming the field.
                raise ValueError(
                    f"text must not contain NUL characters (U+0000) - at `{path}`")


class AgentCreate(Body):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"\S")]
    config: dict[str, Any]


class SessionCreate(Body):
    agent_id: uuid.UUID
    title: Annotated[str, msgspec.Meta(max_length=500)] | None = None
    model: NonBlank | None = None
    approval_mode: ApprovalMode | None = None


class SessionUpdate(Body):
    # UNSET = omitted (unchanged); an explicit null fails validation (422).
    title: Annotated[str, msgspec.Meta(max_length=500)] | msgspec.UnsetType = msgspec.UNSET
    model: NonBlank | msgspec.UnsetType = msgspec.UNSET
    approval_mode: ApprovalMode | msgspec.UnsetType = msgspec.UNSET

    def changes(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__
                if getattr(self, f) is not msgspec.UNSET}


class InputCreate(Body):
    content: Annotated[str, msgspec.Meta(min_length=1, max_length=CONTENT_MAX_CHARS,
                                           pattern=r"\S")]
    mode: Literal["steer", "queue"] = "steer"
    model: NonBlank | None = None
    approval_mode: ApprovalMode | None = None
    client_request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200,
                                                    pattern=r"\S")] | None = None


class Decision(Body):
    call_id: str
    approve: bool
    message: str | None = None


class TurnAnswer(Body):
    decisions: list[Decision] | None = None
    answers: dict[str, str | list[str]] | None = None


class Page(msgspec.Struct):
    items: list[Any]
    next_cursor: str | None
