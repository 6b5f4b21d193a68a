"""Domain types: frozen msgspec Structs shared by services and the API.

Status values mirror the CHECK constraints of sql/001_tables.sql.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from typing import Any

import msgspec


class InputStatus(str, enum.Enum):
    QUEUED = "queued"  # received; its turn waits in the session FIFO
    STARTED = "started"  # its turn is in flight
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TurnStatus(str, enum.Enum):
    QUEUED = "queued"  # waits behind the session's in-flight turn
    RUNNING = "running"  # a run holds or awaits a slot
    WAITING = "waiting"  # suspended on a cooperation wait (no slot)
    WAITING_USER = "waiting_user"  # suspended on an approval or question (no slot)
    CANCELLING = "cancelling"  # cancel committed, cleanup in progress
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


class RunStatus(str, enum.Enum):
    PENDING = "pending"  # needs a slot: in the tree FIFO
    READY = "ready"  # holds a slot; its job is deferred
    RUNNING = "running"  # a worker holds its lease
    COMPLETED = "completed"
    SUSPENDED = "suspended"
    FAILED = "failed"
    CANCELLED = "cancelled"


class InputMode(str, enum.Enum):
    STEER = "steer"
    QUEUE = "queue"


class Scope(msgspec.Struct, frozen=True):
    """(user, app): every row belongs to one; an API key maps to one."""

    user_id: uuid.UUID
    app_id: uuid.UUID

    def params(self) -> dict[str, uuid.UUID]:
        return {"user_id": self.user_id, "app_id": self.app_id}


class Agent(msgspec.Struct, frozen=True):
    id: uuid.UUID
    name: str
    config: dict[str, Any]
    created_at: dt.datetime


class Usage(msgspec.Struct, frozen=True):
    """Token usage of model calls (as the provider reported it)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class QueueState(msgspec.Struct, frozen=True):
    length: int
    paused: bool


class Session(msgspec.Struct, frozen=True):
    id: uuid.UUID
    tree_id: uuid.UUID
    parent_id: uuid.UUID | None
    name: str
    path: str
    title: str | None
    status: str
    agent_id: uuid.UUID | None
    model: str
    approval_mode: str
    created_at: dt.datetime
    current_turn_id: uuid.UUID | None
    queue: QueueState
    # Summed over the session's runs (GET /api/sessions/{id} only).
    usage: Usage | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Session:
        fields = {k: row[k] for k in cls.__struct_fields__ if k in row}
        fields["queue"] = QueueState(length=row["queue_length"], paused=row["queue_paused"])
        return cls(**fields)


class Receipt(msgspec.Struct, frozen=True, omit_defaults=True):
    input_id: uuid.UUID
    session_id: uuid.UUID
    status: str
    turn_id: uuid.UUID | None
    mode: str
    position: int | None
    # With `?wait=`: the created turn's result (terminal or as it stood).
    result: TurnResult | None = None


class Input(msgspec.Struct, frozen=True):
    id: uuid.UUID
    session_id: uuid.UUID
    status: str
    turn_id: uuid.UUID | None
    mode: str
    content: str
    client_request_id: str | None
    model: str | None
    approval_mode: str | None
    error: str | None
    position: int | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


class Run(msgspec.Struct, frozen=True):
    id: uuid.UUID
    turn_id: uuid.UUID
    attempt: int
    status: str
    error: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    usage: Usage | None = None


class Turn(msgspec.Struct, frozen=True):
    id: uuid.UUID
    session_id: uuid.UUID
    input_id: uuid.UUID
    status: str
    result_run_id: uuid.UUID | None
    error: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    runs: list[Run] | None = None
    # What the turn waits for from its user (approval or questions), if any.
    pending: dict[str, Any] | None = None
    # Summed over its runs.
    usage: Usage | None = None


class TurnResult(msgspec.Struct, frozen=True):
    turn_id: uuid.UUID
    status: str
    run_id: uuid.UUID | None
    output: dict[str, Any] | None
    error: str | None


class Event(msgspec.Struct, frozen=True):
    seq: int
    type: str
    session_id: uuid.UUID
    turn_id: uuid.UUID | None
    run_id: uuid.UUID | None
    data: dict[str, Any]
    created_at: dt.datetime


def from_row(cls: type, row: dict[str, Any]) -> Any:
    """Build a Struct from a dict row, ignoring columns it does not have."""
    return cls(**{k: row[k] for k in cls.__struct_fields__ if k in row})
