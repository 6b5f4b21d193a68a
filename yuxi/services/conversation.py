"""The conversation of a session: the archive of earlier turns
(`yuxi.conversation`, sql/140_conversation.sql) followed by the messages its
LangGraph checkpoint holds (the turn in flight, or the last turn that ran).

A completed turn is archived by its completion (complete_run_v1); a turn
that ends otherwise by the next turn's first invocation, which then writes
the checkpoint that forgets it: a checkpoint's size, and what each of its
writes costs, stays that of one turn, whatever the session's history.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import psycopg
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from psycopg_pool import AsyncConnectionPool

from yuxi import db

# The page size of GET /api/sessions/{id}/messages when none is asked for,
# and the largest one accepted.
DEFAULT_LIMIT = 100
MAX_LIMIT = 500
# `before` when the caller gave none: after every position.
END = 2**31 - 1

# The checkpointer's own serializer (AsyncPostgresSaver's default): a message
# read back from the archive is the object the checkpoint would have given.
_SERDE = JsonPlusSerializer()


def message_json(message: BaseMessage, position: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": message.id, "role": message.type, "content": message.content}
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [{"id": c["id"], "name": c["name"], "args": c["args"]}
                             for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        out["name"] = message.name
    if position is not None:
        out["position"] = position
    return out


def _load(serde: str, data: bytes) -> BaseMessage:
    return _SERDE.loads_typed((serde, bytes(data)))


class ArchiveCache:
    """The archived conversations this process loaded, by session: an
    archive only grows (positions 1, 2, ... are never rewritten or removed),
    so what was loaded once stays true, and a run of a long session decodes
    only the messages archived since (decoding every earlier message at
    every run made a run's cost grow with the session's history). At most
    `max_bytes` of messages (as stored) are kept, least recently used
    sessions dropped first; a longer session is not kept at all.

    The messages are shared by the session's runs on this process, one at a
    time (a session runs one turn at a time); nothing changes a message of
    the history."""

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        # session -> (message ids, messages, their bytes as stored)
        self._sessions: OrderedDict[Any, tuple[list[str], list[BaseMessage], int]] = \
            OrderedDict()
        self._size = 0

    def known(self, session_id: Any) -> int:
        """How many of the session's first messages are kept (positions 1
        to that): a read of its archive may start past it."""
        entry = self._sessions.get(session_id)
        return len(entry[0]) if entry else 0

    def load(self, session_id: Any, rows: Sequence[dict[str, Any]], after: int = 0,
             ) -> list[BaseMessage] | None:
        """The session's archived messages, oldest first, decoding only
        what is not kept. `rows` (`message_id`, `serde`, `message`) are the
        archive's past position `after`: 0, the whole archive (checked
        against what is kept, by message id), or what `known` said before
        the read; None when that prefix is not kept any more (dropped
        meanwhile): read the archive whole."""
        ids, loaded, nbytes = self._sessions.pop(session_id, ([], [], 0))
        self._size -= nbytes
        if after:
            if len(ids) != after:
                return None
        elif len(ids) > len(rows) or any(r["message_id"] != i for r, i in zip(rows, ids)):
            ids, loaded, nbytes = [], [], 0  # not a prefix (never expected): decode all
        else:
            rows = rows[len(ids):]
        ids = [*ids, *(r["message_id"] for r in rows)]
        out = [*loaded, *(_load(r["serde"], r["message"]) for r in rows)]
        nbytes += sum(len(r["message"]) for r in rows)
        if nbytes <= self.max_bytes:
            self._sessions[session_id] = (ids, out, nbytes)
            self._size += nbytes
            while self._size > self.max_bytes:
                _, (_, _, dropped) = self._sessions.popitem(last=False)
                self._size -= dropped
        return list(out)

    @property
    def nbytes(self) -> int:
        """Bytes kept (messages as stored)."""
        return self._size


# The worker's cache (yuxi.runtime.executor).
ARCHIVE = ArchiveCache()


def _turn_of(message: BaseMessage) -> str | None:
    if isinstance(message, HumanMessage):
        mark = message.additional_kwargs.get("yuxi") or {}
        if mark.get("turn_start"):
            return mark.get("turn_id")
    return None


def archive_params(messages: Sequence[BaseMessage]) -> dict[str, list[Any]]:
    """Messages as archive_conversation_v1 (and complete_run_v1) take them:
    ids, turns, serializer tags and bytes, in order."""
    ids, turns, serdes, blobs = [], [], [], []
    turn: str | None = None
    for message in messages:
        turn = _turn_of(message) or turn
        serde, data = _SERDE.dumps_typed(message)
        ids.append(message.id)
        turns.append(uuid.UUID(turn) if turn else None)
        serdes.append(serde)
        blobs.append(data)
    return {"ids": ids, "turns": turns, "serde": serdes, "messages": blobs}


async def archive_and_load(conn: psycopg.AsyncConnection, run_id: uuid.UUID,
                           token: uuid.UUID, earlier: Sequence[BaseMessage] = (),
                           cache: tuple[ArchiveCache, Any] | None = None,
                           ) -> list[BaseMessage]:
    """Archive `earlier`, the messages an earlier turn left in the checkpoint
    (fenced by the run's lease; a batch archived already, by the completion
    of its turn or by a run cut off before its reset, is not written twice;
    must commit before the checkpoint that forgets them), and return the
    archived conversation, oldest first: what the run's model sees before
    the checkpoint's messages. One round trip. `cache`: (an ArchiveCache,
    the run's session id) to decode what it does not hold only."""
    rows = await db.fetch_all(conn, "archive_conversation", {
        "run_id": run_id, "token": token, **archive_params(earlier)})
    if cache is not None:
        return cache[0].load(cache[1], rows)
    return [_load(r["serde"], r["message"]) for r in rows]


def archived_history(rows: Sequence[dict[str, Any]], earlier: Sequence[BaseMessage],
                     cache: tuple[ArchiveCache, Any], after: int = 0,
                     ) -> list[BaseMessage] | None:
    """The conversation from the archive's rows past position `after`
    (`conversation_history`), completed by `cache` (an ArchiveCache, the
    session), when it holds `earlier` (what the checkpoint holds of earlier
    turns) already, as after a completed turn: nothing to archive first.
    None otherwise (archive_and_load), or when the cache cannot complete
    the rows any more."""
    history = cache[0].load(cache[1], rows, after)
    if history is None or unarchived(
            earlier, {"message_id": history[-1].id} if history else None):
        return None
    return history


async def _checkpoint_messages(source: AsyncConnectionPool | psycopg.AsyncConnection,
                               session_id: uuid.UUID) -> list[BaseMessage]:
    """The messages of the latest checkpoint (without pending writes of a
    step in progress)."""
    saver = AsyncPostgresSaver(source)
    found = await saver.aget_tuple(
        {"configurable": {"thread_id": str(session_id), "checkpoint_ns": ""}})
    if found is None:
        return []
    return list(found.checkpoint["channel_values"].get("messages", []))


def unarchived(messages: Sequence[BaseMessage], last: dict[str, Any] | None) -> list[BaseMessage]:
    """The checkpoint's messages unless the archive holds them already (its
    last row is their last message: archived by a turn whose checkpoint reset
    has not committed yet)."""
    if messages and last is not None and last["message_id"] == messages[-1].id:
        return []
    return list(messages)


async def messages(checkpoint_pool: AsyncConnectionPool, session_id: uuid.UUID, *,
                   limit: int | None = None, before: int | None = None) -> list[dict]:
    """The conversation, oldest first, each message with its `position`:
    the last `limit` messages before position `before` (all of them when
    `limit` is None). Reads `limit` archive rows by a primary-key range and,
    only when the page reaches past the archive, the latest checkpoint (one
    turn's messages): O(page), never O(history).

    The checkpoint is read before the archive's last row: a run archives a
    batch before the checkpoint that forgets it, so a checkpoint read first
    is either archived by then (its last message is the last row: skipped)
    or not (the archive has not grown past it); read the other way round, a
    turn starting in between would hide the batch it archived."""
    bound = END if before is None else before
    # One connection for every read: a request never holds one connection
    # of the pool while it waits for another.
    async with checkpoint_pool.connection() as conn:
        checkpoint: list[BaseMessage] | None = None
        if before is None:
            checkpoint = await _checkpoint_messages(conn, session_id)
        last = await db.fetch_one(conn, "conversation_last", {"session_id": session_id})
        if checkpoint is None and bound > (last["position"] if last else 0) + 1:
            checkpoint = await _checkpoint_messages(conn, session_id)
            last = await db.fetch_one(conn, "conversation_last", {"session_id": session_id})
        archived = last["position"] if last else 0
        pending = unarchived(checkpoint or [], last)
        tail = [message_json(m, archived + i) for i, m in enumerate(pending, 1)
                if archived + i < bound]
        if limit is not None:
            tail = tail[-limit:]
        want = None if limit is None else limit - len(tail)
        rows = []
        if (want is None or want > 0) and archived > 0:
            rows = await db.fetch_all(conn, "conversation_page", {
                "session_id": session_id, "before": min(bound, archived + 1),
                "limit": want})
    head = [message_json(_load(r["serde"], r["message"]), r["position"]) for r in reversed(rows)]
    return head + tail
