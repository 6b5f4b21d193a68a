"""GroupCommit (yuxi.runtime.group_commit): the parallel calls of a step go
in few batches, and each caller gets its own item's outcome."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from yuxi.runtime.group_commit import GroupCommit


class Store:
    """A flush that records its batches and can be held open."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def flush(self, items: list[int]) -> list[object]:
        self.batches.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        # An odd item fails on its own; the others get their double.
        return [ValueError(f"odd {i}") if i % 2 else i * 2 for i in items]


async def in_flight(store: Store, commit: GroupCommit, item: int) -> asyncio.Future:
    """`item` submitted alone, its batch held open in the flush."""
    store.gate = asyncio.Event()
    future = asyncio.ensure_future(commit.submit(item))
    await asyncio.sleep(0.01)
    assert store.batches[-1] == [item]
    return future


async def test_calls_of_one_step_go_in_one_batch_and_get_their_own_outcomes():
    store = Store()
    commit = GroupCommit(store.flush)
    results = await asyncio.gather(*(commit.submit(i) for i in range(6)),
                                   return_exceptions=True)
    assert store.batches == [[0, 1, 2, 3, 4, 5]]
    assert [r if isinstance(r, int) else str(r) for r in results] == [
        0, "odd 1", 4, "odd 3", 8, "odd 5"]


async def test_calls_one_loop_turn_behind_the_first_join_its_batch():
    # LangGraph starts a step's tasks together, but a task may pass one
    # await before it reports (its own wrapper): it still joins the batch.
    store = Store()
    commit = GroupCommit(store.flush)

    async def behind(i: int) -> object:
        await asyncio.sleep(0)
        return await commit.submit(i)

    await asyncio.gather(commit.submit(0), *(behind(2 * i) for i in range(1, 4)))
    assert store.batches == [[0, 2, 4, 6]]


async def test_items_arriving_during_a_flush_go_in_the_next_batch():
    store = Store()
    commit = GroupCommit(store.flush)
    first = await in_flight(store, commit, 0)
    later = [asyncio.ensure_future(commit.submit(i)) for i in (2, 4, 6)]
    await asyncio.sleep(0.01)
    assert store.batches == [[0]]
    store.gate.set()
    assert await first == 0 and [await f for f in later] == [4, 8, 12]
    assert store.batches == [[0], [2, 4, 6]]


async def test_a_failed_flush_fails_its_callers_and_the_commit_goes_on():
    store = Store()
    commit = GroupCommit(store.flush)
    first = await in_flight(store, commit, 0)
    store.fail = RuntimeError("database away")
    store.gate.set()
    with pytest.raises(RuntimeError):
        await first
    store.fail = None
    assert await commit.submit(4) == 8


async def test_a_batch_holds_at_most_limit_items():
    store = Store()
    commit = GroupCommit(store.flush, limit=4)
    await asyncio.gather(*(commit.submit(2 * i) for i in range(10)))
    assert [len(b) for b in store.batches] == [4, 4, 2]


async def test_a_cancelled_caller_s_waiting_item_is_not_sent():
    store = Store()
    commit = GroupCommit(store.flush)
    first = await in_flight(store, commit, 0)
    dropped = asyncio.ensure_future(commit.submit(2))
    kept = asyncio.ensure_future(commit.submit(4))
    await asyncio.sleep(0.01)
    dropped.cancel()
    store.gate.set()
    assert await first == 0 and await kept == 8
    assert store.batches == [[0], [4]]


async def test_settled_waits_for_the_items_in_flight():
    store = Store()
    commit = GroupCommit(store.flush)
    pending = await in_flight(store, commit, 0)
    settled = asyncio.ensure_future(commit.settled())
    await asyncio.sleep(0.01)
    assert not settled.done()
    store.gate.set()
    await settled
    assert pending.done() and pending.result() == 0
    await asyncio.wait_for(commit.settled(), 1)  # nothing in flight: at once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=40),
       st.integers(1, 8))
def test_every_item_is_flushed_once_in_order_and_answered(arrivals, limit):
    """Items arriving at any moments (0-3 loop turns apart) are each flushed
    exactly once, in batches of at most `limit`, and
    every caller gets its own item's outcome."""
    async def scenario() -> None:
        store = Store()
        commit = GroupCommit(store.flush, limit=limit)

        async def caller(item: int, delay: int) -> object:
            for _ in range(delay):
                await asyncio.sleep(0)
            try:
                return await commit.submit(item)
            except ValueError as exc:
                return str(exc)

        items = [2 * i if odd_free else 2 * i + 1 for i, (odd_free, _) in
                 enumerate((a % 3 != 0, d) for a, d in arrivals)]
        results = await asyncio.gather(*(caller(item, d) for item, (_, d) in
                                         zip(items, arrivals)))
        flushed = [i for b in store.batches for i in b]
        assert sorted(flushed) == sorted(items)
        assert all(1 <= len(b) <= limit for b in store.batches)
        assert results == [i * 2 if i % 2 == 0 else f"odd {i}" for i in items]
        await commit.settled()

    asyncio.run(scenario())
