"""The API's hub watches the trees its feeds follow (yuxi.event_watches),
under its LISTEN connection's backend, and moves the watches to a new
connection when it reconnects: only a watched tree's transactions notify."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_slots import make_tree
from yuxi.api.hub import EventHub

EMIT = "SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.event', '{}', NULL)"
WATCHERS = "SELECT pid FROM yuxi.event_watches WHERE tree_id = %s ORDER BY pid"


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def _pids(pool, tree) -> list[int]:
    async with pool.connection() as conn:
        return [r["pid"] for r in await (await conn.execute(WATCHERS, (tree,))).fetchall()]


async def _emit(pool, tree, root) -> None:
    async with pool.connection() as conn:
        await conn.execute(EMIT, (tree, root))


@pytest.fixture
async def hub(db_url, pool):
    hub = EventHub(db_url, pool=pool)
    await hub.start()

    async def connected() -> bool:
        return hub.connected

    await _until(connected, "the hub never listened")
    yield hub
    await hub.stop()


async def test_the_hub_watches_what_it_follows_across_reconnects(hub, pool, postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    with hub.subscribe(str(tree)) as wake:
        async with hub.watching(str(tree)), hub.watching(str(tree)):  # two feeds: one watch
            listener = hub._pid
            assert await _pids(pool, tree) == [listener]  # committed when the block starts
            await _emit(pool, tree, root)
            await asyncio.wait_for(wake.wait(), 5)

            # The LISTEN connection dies: the new one watches the same trees.
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_terminate_backend(%s)", (listener,))

            async def moved() -> bool:
                return hub.connected and hub._pid not in (None, listener) \
                    and await _pids(pool, tree) == [hub._pid]

            await _until(moved, "the watch did not move to the new connection")
            wake.clear()
            await _emit(pool, tree, root)
            await asyncio.wait_for(wake.wait(), 5)

    async def dropped() -> bool:
        return await _pids(pool, tree) == []

    await _until(dropped, "the last feed's exit left the watch")


async def test_a_tree_followed_while_the_hub_is_away_is_watched_when_it_is_back(hub, pool,
                                                                                  postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    listener = hub._pid
    hub._pid = None  # as between a lost connection and the next (hub._disconnected)
    with hub.subscribe(str(tree)) as wake:
        async with hub.watching(str(tree)):
            assert await _pids(pool, tree) == []  # nobody listens for it yet
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_terminate_backend(%s)", (listener,))

            async def back() -> bool:
                return hub.connected and hub._pid not in (None, listener) \
                    and await _pids(pool, tree) == [hub._pid]

            await _until(back, "the reconnect did not watch the tree")
            wake.clear()
            await _emit(pool, tree, root)
            await asyncio.wait_for(wake.wait(), 5)
