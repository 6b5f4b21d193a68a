"""The API's hub watches the trees its feeds follow (yuxi.event_watches),
under its LISTEN connection's backend, and moves the watches to a new
connection when it reconnects: only a watched tree's transactions notify."""

from __future__ import annotations

import asyncio

from tests.e2e.helpers import wait_for
from tests.integration.test_slots import make_tree
from tests.integration.test_wait_result import hub  # noqa: F401 (the fixture)

EMIT = "SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.event', '{}', NULL)"
WATCHERS = "SELECT pid FROM yuxi.event_watches WHERE tree_id = %s ORDER BY pid"


async def _pids(pool, tree) -> list[int]:
    async with pool.connection() as conn:
        return [r["pid"] for r in await (await conn.execute(WATCHERS, (tree,))).fetchall()]


async def _emit(pool, tree, root) -> None:
    async with pool.connection() as conn:
        await conn.execute(EMIT, (tree, root))


async def _reconnect_keeps_the_watch(hub, pool, tree, root, wake) -> None:
    """End the hub's LISTEN connection; the new one must watch the tree, and
    the tree's next event must wake `wake`."""
    listener = hub._last_pid
    async with pool.connection() as conn:
        await conn.execute("SELECT pg_terminate_backend(%s)", (listener,))

    async def moved() -> bool:
        return hub.connected and hub._pid not in (None, listener) \
            and await _pids(pool, tree) == [hub._pid]

    await wait_for(moved, 10, "the new connection to watch the tree", interval=0.01)
    wake.clear()
    await _emit(pool, tree, root)
    await asyncio.wait_for(wake.wait(), 5)


async def test_the_hub_watches_what_it_follows_across_reconnects(hub, pool, postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    with hub.subscribe(str(tree)) as wake:
        async with hub.watching(str(tree)), hub.watching(str(tree)):  # two feeds: one watch
            assert await _pids(pool, tree) == [hub._pid]  # committed when the block starts
            await _emit(pool, tree, root)
            await asyncio.wait_for(wake.wait(), 5)
            await _reconnect_keeps_the_watch(hub, pool, tree, root, wake)

    async def dropped() -> bool:
        return await _pids(pool, tree) == []

    await wait_for(dropped, 10, "the last feed's exit to drop the watch", interval=0.01)


async def test_a_tree_followed_while_the_hub_is_away_is_watched_when_it_is_back(hub, pool,
                                                                                  postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    hub._pid = None  # as between a lost connection and the next (hub._disconnected)
    with hub.subscribe(str(tree)) as wake:
        async with hub.watching(str(tree)):
            assert await _pids(pool, tree) == []  # nobody listens for it yet
            await _reconnect_keeps_the_watch(hub, pool, tree, root, wake)
