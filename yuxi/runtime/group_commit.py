"""Group commit: the parallel tool calls of one model step write together.

A model answer with N tool calls runs N graph tasks at once, and each writes
its `tool.started` event, its effect (a cooperation tool's) and its
`tool.finished` event, and LangGraph saves its result. One statement and one
commit each would be 3-4 x N transactions taking the tree's lock in turn (a
fan-out of 64 children: ~250 of them), and a child's claim would queue
behind them. Instead each kind of write goes through a GroupCommit: the
first caller's item goes out at once (after the callers scheduled in the
same loop iteration joined it), and the items that arrive while a batch is
in flight go together in the next one. Every caller still returns only once
its own item is committed, with its own result or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """`flush(items)` writes a batch in one transaction and returns one
    outcome per item: its result, or an exception instance for that item's
    caller alone. An exception `flush` raises goes to every caller of the
    batch. At most `limit` items go in one batch."""

    def __init__(self, flush: Callable[[list[T]], Awaitable[list[R | BaseException]]], *,
                 limit: int = 64) -> None:
        self._flush = flush
        self._limit = limit
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_pending())
        # A caller cancelled while its item waits drops the item (below); one
        # cancelled while its batch is in flight leaves the batch be: it was
        # sent, as a statement in flight would be.
        return await future

    async def settled(self) -> None:
        """Return once nothing is pending or in flight (a write that must
        come after the submitted items waits for them)."""
        while self._drain is not None:
            await asyncio.shield(self._drain)

    async def _drain_pending(self) -> None:
        try:
            # The tasks of one step were scheduled together: let them reach
            # `submit` before the first batch goes.
            await asyncio.sleep(0)
            while True:
                batch = [(item, f) for item, f in self._pending[:self._limit] if not f.done()]
                del self._pending[:self._limit]
                if not batch:
                    if not self._pending:
                        return
                    continue
                try:
                    outcomes = await self._flush([item for item, _ in batch])
                except asyncio.CancelledError:
                    for _, f in batch:
                        f.cancel()
                    raise
                except Exception as exc:
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                for (_, f), outcome in zip(batch, outcomes, strict=True):
                    if f.done():
                        continue
                    if isinstance(outcome, BaseException):
                        f.set_exception(outcome)
                    else:
                        f.set_result(outcome)
        finally:
            self._drain = None
            # Cancelled with callers still waiting (the worker stops): they
            # must not wait forever.
            for _, f in self._pending:
                if not f.done():
                    f.cancel()
            self._pending.clear()
