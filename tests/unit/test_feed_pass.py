"""A delivery pass of the SSE feed (yuxi.api.feed.TreeFeed): the event loop
runs every SLICE subscribers, and rows read meanwhile reach the subscribers
the pass has not reached yet in the same write as the rows before them."""

from __future__ import annotations

import asyncio

from yuxi.api import feed
from yuxi.api.feed import Feeds, Subscriber, TreeFeed
from yuxi.settings import Settings

SUBSCRIBERS = 3 * feed.SLICE


def row(seq: int) -> dict:
    return {"seq": seq, "type": "message", "session_id": "s", "turn_id": None,
            "run_id": None, "data": {"n": seq}, "created_at": "2026-12-01T00:00:00Z"}


def window_of(*seqs: int) -> tuple[TreeFeed, list[list[bytes]]]:
    """A tree's feed whose window holds `seqs`, and SUBSCRIBERS level with
    its start; each subscriber's writes (ASGI bodies) are recorded."""
    feeds = Feeds(None, None, Settings())
    tree = TreeFeed(feeds, "tree")
    tree.high = 0
    writes: list[list[bytes]] = []
    for _ in range(SUBSCRIBERS):
        mine: list[bytes] = []

        async def send(message: dict, mine: list[bytes] = mine) -> None:
            mine.append(message["body"])

        sub = Subscriber(feeds, "tree", None, 0, send)
        sub.feed = tree
        tree.subscribers[id(sub)] = sub
        writes.append(mine)
    tree._append([row(s) for s in seqs])
    return tree, writes


async def test_rows_read_during_a_pass_go_out_with_it():
    tree, writes = window_of(1)
    delivering = asyncio.ensure_future(tree._deliver())
    await asyncio.sleep(0)  # the pass wrote to its first SLICE subscribers, then let us run
    tree._append([row(2)])  # a read that ends meanwhile
    await delivering
    one, both = feed.frame(row(1)), feed.frame(row(1)) + feed.frame(row(2))
    assert writes[:feed.SLICE] == [[one]] * feed.SLICE
    # The rest took row 2 in the same write as row 1: one write each.
    assert writes[feed.SLICE:] == [[both]] * (SUBSCRIBERS - feed.SLICE)
    # The next pass gives row 2 to the ones the first had passed, and
    # writes nothing to the others.
    await tree._deliver()
    assert writes[:feed.SLICE] == [[one, feed.frame(row(2))]] * feed.SLICE
    assert writes[feed.SLICE:] == [[both]] * (SUBSCRIBERS - feed.SLICE)


async def test_a_pass_without_new_rows_writes_each_subscriber_once():
    tree, writes = window_of(1, 2)
    await tree._deliver()
    await tree._deliver()
    assert writes == [[feed.frame(row(1)) + feed.frame(row(2))]] * SUBSCRIBERS
