"""Connections and named queries.

All SQL lives in `sql/`: numbered files hold the schema and the functions that
own state transitions, `sql/queries.sql` holds the named queries Python runs
(`-- name: <query>` blocks), loaded once into QUERIES.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, LiteralString, cast

import psycopg
from psycopg import sql
from psycopg.adapt import AdaptersMap
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types import string as _string
from psycopg.types.json import set_json_dumps
from psycopg_pool import AsyncConnectionPool

from yuxi import errors

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
PROCRASTINATE_SCHEMA = "procrastinate"
CHECKPOINT_SCHEMA = "langgraph"


def _load_queries(path: Path) -> dict[str, LiteralString]:
    queries: dict[str, LiteralString] = {}
    for block in re.split(r"^-- name: ", path.read_text(), flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        queries[name.strip()] = cast(LiteralString, body.strip().rstrip(";"))
    return queries


QUERIES = _load_queries(SQL_DIR / "queries.sql")


# --------------------------------------------------------------------------
# NUL characters. PostgreSQL text and jsonb cannot hold U+0000 (text raises
# 22021, jsonb 22P05). The API refuses it in request bodies (422, see
# yuxi.api.schemas); text that models and tools write (tool arguments and
# results, answers, cooperation messages) is stored with each NUL replaced by
# U+FFFD (the replacement character). Every connection of our pools dumps
# str and Json/Jsonb parameters through ADAPTERS, which does that.

NUL = "\x00"
NUL_REPLACEMENT = "\ufffd"
# A JSON `\u0000` escape preceded by an even number of backslashes (an odd
# number makes it the literal text "\u0000", which is fine to store).
_JSON_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def strip_nul(text: str) -> str:
    return text.replace(NUL, NUL_REPLACEMENT) if NUL in text else text


def json_dumps(obj: Any) -> str:
    text = json.dumps(obj)
    if "\\u0000" in text:
        text = _JSON_NUL.sub(r"\1\\ufffd", text)
    return text


def _nul_safe(base: type) -> type:
    def dump(self, obj: str):
        return base.dump(self, strip_nul(obj))
    return type(f"NulSafe{base.__name__}", (base,), {"dump": dump})


ADAPTERS = AdaptersMap(psycopg.adapters)
# The order of psycopg's own registration: the last one is the default.
for _base in (_string.StrBinaryDumperName, _string.StrBinaryDumperVarchar,
              _string.StrBinaryDumper, _string.StrDumperName, _string.StrDumperVarchar,
              _string.StrDumper, _string.StrDumperUnknown):
    ADAPTERS.register_dumper(str, _nul_safe(_base))


class _AdaptContext:
    adapters = ADAPTERS
    connection = None


set_json_dumps(json_dumps, _AdaptContext())  # type: ignore[arg-type]

# Seconds a new connection may take (a server that does not answer is an
# outage, not a hang).
CONNECT_TIMEOUT = 5
# psycopg_pool retries a failed connection with an uncapped exponential
# backoff (1, 2, 4, ... 64 s into a two-minute outage). Giving up after a
# few seconds caps it: the next request that needs a connection starts a
# fresh attempt at once, so a pool is back within seconds of its server.
RECONNECT_TIMEOUT = 4.0
# Seconds after which the server ends a LISTEN connection whose peer is gone
# without a word (a powered-off host, a dropped route): its TCP keepalives
# go unanswered, or notifications it sends stay unacknowledged. Without it
# the server holds such a backend for about two hours (the kernel's
# keepalive default): a worker's stays listed among the claimers, and one
# blocked sending notifications holds back the cleanup of the server's
# NOTIFY queue, which every listener shares.
PEER_GONE_SECONDS = 30


def with_search_path(url: str, schema: str) -> str:
    """The same server and database, with `schema` first on the search path."""
    return make_conninfo(url, options=f"-c search_path={schema},public")


def database_name(url: str) -> str:
    return conninfo_to_dict(url).get("dbname") or "postgres"


def with_database(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


def app_pool(url: str, *, min_size: int = 1, max_size: int = 10,
             prepare: bool = True, timeout: float = 30.0) -> AsyncConnectionPool:
    """Pool for yuxi queries: autocommit (a SQL function call is its own
    transaction; multi-statement work uses `transaction()`), dict rows.
    `prepare=False` behind a transaction pooler (PgBouncer): no server-side
    prepared statements, which would not follow the next transaction.
    `timeout`: how long a caller waits for a connection before PoolTimeout
    (an OperationalError: the database counts as unavailable)."""
    kwargs: dict[str, Any] = {"autocommit": True, "row_factory": dict_row, "context": ADAPTERS,
                              "connect_timeout": CONNECT_TIMEOUT}
    if not prepare:
        kwargs["prepare_threshold"] = None
    return AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        reconnect_timeout=RECONNECT_TIMEOUT,
        kwargs=kwargs,
        open=False,
        name="yuxi",
    )


def checkpoint_pool(url: str, *, min_size: int = 1, max_size: int = 10,
                    timeout: float = 30.0) -> AsyncConnectionPool:
    """Pool for the LangGraph checkpointer, in its own schema (a run borrows
    one connection and marks it with its lease: yuxi.runtime.saver)."""
    return AsyncConnectionPool(
        with_search_path(url, CHECKPOINT_SCHEMA),
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        reconnect_timeout=RECONNECT_TIMEOUT,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row,
                "context": ADAPTERS, "connect_timeout": CONNECT_TIMEOUT},
        open=False,
        name="yuxi-checkpoints",
    )


@contextlib.contextmanager
def domain_errors():
    """Re-raise database errors that stand for domain errors as those."""
    try:
        yield
    except psycopg.Error as exc:
        mapped = errors.from_db(exc)
        if mapped is None:
            raise
        raise mapped from exc


async def fetch_one(conn: psycopg.AsyncConnection, query: str, params: Any = None) -> Any:
    with domain_errors():
        cur = await conn.execute(QUERIES[query], params)
        return await cur.fetchone()


async def fetch_all(conn: psycopg.AsyncConnection, query: str, params: Any = None) -> list[Any]:
    with domain_errors():
        cur = await conn.execute(QUERIES[query], params)
        return await cur.fetchall()


async def execute(conn: psycopg.AsyncConnection, query: str, params: Any = None) -> None:
    with domain_errors():
        await conn.execute(QUERIES[query], params)


@contextlib.asynccontextmanager
async def connection(
    source: AsyncConnectionPool | psycopg.AsyncConnection,
) -> AsyncIterator[psycopg.AsyncConnection]:
    """A connection of a pool, or the connection the caller holds."""
    if isinstance(source, AsyncConnectionPool):
        async with source.connection() as conn:
            yield conn
    else:
        yield source


@contextlib.asynccontextmanager
async def transaction(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    """One connection and one transaction: a service call's unit of work."""
    async with pool.connection() as conn, conn.transaction():
        yield conn


def _listener_timeouts(gone_seconds: float) -> dict[str, str]:
    """The server's TCP settings that end a connection whose peer has been
    silent for about `gone_seconds`: the first keepalive after a third of
    it, then 3 probes a sixth apart; data left unacknowledged as long (a
    zero window included) ends it too."""
    return {"idle": str(max(1, round(gone_seconds / 3))),
            "interval": str(max(1, round(gone_seconds / 6))),
            "count": "3",
            "user_timeout": str(max(1, round(gone_seconds * 1000)))}


async def listen_forever(url: str, channels: tuple[str, ...] | Callable[[], tuple[str, ...]],
                         on_note, *, what: str,
                         on_open=None, on_connect=None, on_disconnect=None,
                         poll_seconds: float = 5.0) -> None:
    """A process's LISTEN connection on `channels` (or on what `channels()`
    returns at each connect), kept up for good: each notification goes to
    `on_note`; a lost connection is reopened with backoff (0.2 s doubling
    to 5 s). `on_open(conn)`, a coroutine, runs before the LISTENs;
    `on_connect(conn)` runs once listening (the notifications sent
    while disconnected are gone: catch up there), `on_disconnect()` when the
    connection is lost. Runs until cancelled.

    Every `poll_seconds` the connection makes a round trip, and one that
    takes longer than that counts as lost: a listener only reads, so a peer
    gone without a word (a dropped NAT entry, a silent network, a frozen
    server) would otherwise leave it deaf for good. The round trip is the
    first channel's LISTEN again, a no-op in the server, so the connection's
    last statement stays a LISTEN: how operators and tests tell listeners
    in pg_stat_activity. The server side, in turn, ends the connection of a
    peer gone for good within PEER_GONE_SECONDS (TCP keepalives and
    tcp_user_timeout, set per connection; a Unix socket has neither)."""
    log = logging.getLogger("yuxi.listen")
    backoff = 0.2
    while True:
        try:
            # A deadline on the connect too: a silent server would hold it for minutes.
            async with await psycopg.AsyncConnection.connect(
                    url, autocommit=True, connect_timeout=CONNECT_TIMEOUT) as conn:
                # Quoted: Procrastinate's channels hold '#' and '@'.
                listens = [sql.SQL("LISTEN {}").format(sql.Identifier(channel))
                           for channel in (channels() if callable(channels) else channels)]
                await execute(conn, "listener_timeouts", _listener_timeouts(PEER_GONE_SECONDS))
                if on_open is not None:
                    await on_open(conn)
                for listen in listens:
                    await conn.execute(listen)
                backoff = 0.2
                if on_connect is not None:
                    on_connect(conn)
                while True:
                    async for note in conn.notifies(timeout=poll_seconds):
                        on_note(note)
                    async with asyncio.timeout(poll_seconds):
                        await conn.execute(listens[0])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s lost its connection: %s", what,
                        "no answer to its poll" if isinstance(exc, TimeoutError) else exc)
        finally:
            if on_disconnect is not None:
                on_disconnect()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5.0)
