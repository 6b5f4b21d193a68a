"""A LISTEN connection notices a peer that stopped answering (db.listen_forever).

A listener only reads, so when the server or the network goes silent
without closing the connection (a dropped NAT entry, a frozen host), it
would wait for notifications for good: a worker would hear no more claims,
cancels or jobs, an API no more events. Its poll is a round trip with a
deadline; one that gets no answer in time makes the connection again.

The silence is real: the listener reaches PostgreSQL through a TCP relay in
this test, which stops passing bytes on the connections it has (keeping
them open) while new ones pass."""

from __future__ import annotations

import asyncio
import contextlib

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.e2e.helpers import wait_for
from tests.integration.helpers import rows, scalar
from yuxi import db
from yuxi.runtime.live import WorkerListener

POLL = 0.2
CLAIMERS = "SELECT pid FROM yuxi.claimers_v1()"


class Relay:
    """A TCP relay to the database that can go silent on its connections."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.frozen: list[asyncio.Event] = []  # one per relayed connection
        self.silent = False  # new connections too pass nothing
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @property
    def address(self) -> tuple[str, int]:
        return self.server.sockets[0].getsockname()[:2]

    def freeze(self) -> None:
        """Its current connections pass nothing more, and stay open."""
        for frozen in self.frozen:
            frozen.set()

    async def _relay(self, client_reader, client_writer) -> None:
        self.tasks.add(asyncio.current_task())
        self.writers.append(client_writer)
        if self.host.startswith("/"):
            server_reader, server_writer = await asyncio.open_unix_connection(
                f"{self.host}/.s.PGSQL.{self.port}")
        else:
            server_reader, server_writer = await asyncio.open_connection(self.host, self.port)
        self.writers.append(server_writer)
        frozen = asyncio.Event()
        if self.silent:
            frozen.set()
        self.frozen.append(frozen)

        async def pipe(reader, writer) -> None:
            while data := await reader.read(65536):
                if frozen.is_set():
                    await asyncio.Future()  # swallowed: silence, the socket open
                writer.write(data)
                await writer.drain()
            writer.close()  # the peer's end, passed on (a cancel request ends so)

        with contextlib.suppress(Exception):
            await asyncio.gather(pipe(client_reader, server_writer),
                                 pipe(server_reader, client_writer))


async def _claimers_are(pool, pids: list[int]) -> bool:
    return await rows(pool, CLAIMERS) == [{"pid": pid} for pid in pids]


def _claiming(url: str) -> WorkerListener:
    listener = WorkerListener(url, poll_seconds=POLL)
    listener.on_ready, listener.claimer_host = (lambda payload: None), "test-host"
    return listener


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _stop(listener: WorkerListener) -> None:
    stopped = listener.stop_claiming()
    await _cancel(stopped)
    await _cancel(listener._task)


async def _until(condition, timeout: float, what: str) -> None:
    """tests.e2e.helpers.wait_for on a plain condition."""
    await wait_for(lambda: asyncio.sleep(0, condition()), timeout, what, interval=0.02)


@contextlib.asynccontextmanager
async def _listening(url: str, channels: tuple[str, ...], on_note=lambda note: None,
                     on_open=None):
    """db.listen_forever in a task for the block; yields the backend pid of
    each connection it made (appended at each connect)."""
    connects: list[int] = []
    task = asyncio.create_task(db.listen_forever(
        url, channels, on_note, what="test listener", on_open=on_open,
        on_connect=lambda conn: connects.append(conn.info.backend_pid), poll_seconds=POLL))
    try:
        yield connects
    finally:
        await _cancel(task)


def _through(db_url: str, relay: Relay) -> str:
    host, port = relay.address
    return make_conninfo(db_url, host=host, port=port)


def _over_tcp(db_url: str) -> str:
    """The same database over TCP: on a Unix socket the server has no TCP
    settings (they show 0)."""
    host = conninfo_to_dict(db_url).get("host") or ""
    return make_conninfo(db_url, host="127.0.0.1") if host.startswith("/") else db_url


def _target(db_url: str) -> tuple[str, int]:
    params = conninfo_to_dict(db_url)
    return params.get("host") or "127.0.0.1", int(params.get("port") or 5432)


async def test_a_listener_whose_peer_went_silent_connects_again(db_url, pool):
    heard: list[str] = []
    async with Relay(*_target(db_url)) as relay, _listening(
            _through(db_url, relay), ("yuxi_probe",),
            lambda note: heard.append(note.payload)) as connects:
        await _until(lambda: connects, 10, "a connection")
        await asyncio.sleep(3 * POLL)  # polls answered: the same connection
        assert len(connects) == 1
        relay.freeze()
        # Psycopg's own cancel of the unanswered poll takes up to 10 s more.
        await _until(lambda: len(connects) == 2, 15, "a second connection")
        async with pool.connection() as conn:
            await conn.execute("NOTIFY yuxi_probe, 'after'")
        await _until(lambda: "after" in heard, 5, "the NOTIFY after it")


async def test_a_connect_that_gets_no_answer_is_tried_again(db_url, monkeypatch):
    """A silent server holds a connect for minutes (TCP's own retries): the
    connect has a deadline too (db.CONNECT_TIMEOUT; 2 s, libpq's least)."""
    monkeypatch.setattr(db, "CONNECT_TIMEOUT", 2)
    async with Relay(*_target(db_url)) as relay:
        relay.silent = True
        async with _listening(_through(db_url, relay), ("yuxi_probe",)) as connects:
            await asyncio.sleep(0.5)  # the first connect is under way, and gets no answer
            assert relay.frozen and not connects
            relay.silent = False
            await _until(lambda: connects, 10, "a connection")


async def test_the_poll_leaves_a_listen_as_the_connections_last_statement(db_url, pool):
    """Operators and tests tell the listeners in pg_stat_activity by it."""
    async with _listening(db_url, ("yuxi_probe", "yuxi_other")) as connects:
        await _until(lambda: connects, 10, "a connection")
        await asyncio.sleep(3 * POLL)
        query = await scalar(pool, "SELECT query FROM pg_stat_activity WHERE pid = %s",
                             (connects[0],))
        assert query == 'LISTEN "yuxi_probe"'


async def test_a_claiming_worker_listener_polls_and_ends_its_former_connection(db_url, pool):
    """The claims connection (whose connect records the claimer's pid) makes
    the same round trip: before, its poll only read the pid, so a silent
    peer went unnoticed. Made again, it ends the former connection, which
    the server still holds: left listed among the claimers, it would be
    announced runs that nobody claims."""
    async with Relay(*_target(db_url)) as relay:
        listener = _claiming(_through(db_url, relay))
        listener.start()
        try:
            assert await listener.ready(10)
            first = listener.pid
            assert await _claimers_are(pool, [first])
            relay.freeze()
            await _until(lambda: listener.pid != first and listener._ready.is_set(), 15,
                         "the claims connection made again")
            assert listener.claimer == listener.pid != first
            # The terminated backend's exit.
            await wait_for(lambda: _claimers_are(pool, [listener.pid]), 5,
                           "the former claims backend gone", interval=0.02)
        finally:
            await _stop(listener)


async def test_ending_a_former_claimer_spares_other_clients(db_url, pool):
    """A pid under another name (a backend the server has since given the
    pid to) is left alone."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
        listener = _claiming(db_url)
        listener.pid = other.info.backend_pid  # as if it had been ours
        listener.start()
        try:
            assert await listener.ready(10)
            assert (await (await other.execute("SELECT 1")).fetchone()) == (1,)
        finally:
            await _stop(listener)


async def test_a_listener_asks_the_server_to_end_it_once_its_peer_is_gone(db_url):
    """The server's TCP settings of each LISTEN connection (db.PEER_GONE_SECONDS)."""
    shown: dict[str, str] = {}

    async def show(conn) -> None:
        # All four at once: the wait below ends as soon as `shown` is filled.
        shown.update({name: (await (await conn.execute(f"SHOW {name}")).fetchone())[0]
                      for name in ("tcp_keepalives_idle", "tcp_keepalives_interval",
                                   "tcp_keepalives_count", "tcp_user_timeout")})

    async with _listening(_over_tcp(db_url), ("yuxi_probe",), on_open=show):
        await _until(lambda: shown, 10, "a connection")
    assert shown == {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5",
                     "tcp_keepalives_count": "3", "tcp_user_timeout": "30000"}


async def test_the_server_ends_a_listener_whose_peer_stopped_reading(db_url, pool, monkeypatch):
    """A peer gone for good while the server had notifications to send it:
    the backend blocks in its send (the peer's window is shut), which holds
    back the server's NOTIFY queue for every listener. Its tcp_user_timeout
    ends it; without it the backend waits for about two hours. (The relay's
    kernel still answers, so this is the zero window, not silence: Linux
    since 5.1 ends its probing of a shut window at tcp_user_timeout.)"""
    monkeypatch.setattr(db, "PEER_GONE_SECONDS", 1)
    async with Relay(*_target(_over_tcp(db_url))) as relay, _listening(
            _through(db_url, relay), ("yuxi_probe",)) as connects:
        await _until(lambda: connects, 10, "a connection")
        ghost = connects[0]
        relay.freeze()
        # More than the socket buffers between the backend and the relay hold.
        async with pool.connection() as conn:
            await conn.execute("SELECT pg_notify('yuxi_probe', repeat('x', 7990) || i)"
                               " FROM generate_series(1, 3000) i")

        async def ended() -> bool:
            return not await rows(pool, "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                  (ghost,))
        await wait_for(ended, 15, "the ghost's backend ended", interval=0.1)
