"""ensure_server: the configured server when it answers, an error when an
explicit URL does not, the embedded server otherwise."""

from __future__ import annotations

import socket
import time

import psycopg
import pytest

from yuxi import pgserver, schema
from yuxi.errors import DatabaseUnavailable
from yuxi.settings import Settings


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def settings_for(url: str, *, explicit: bool) -> Settings:
    return Settings(database_url=url, database_url_explicit=explicit)


async def test_explicit_url_that_does_not_answer_is_an_error(tmp_path):
    port = unused_port()
    settings = settings_for(f"postgresql://postgres@127.0.0.1:{port}/yuxi", explicit=True)
    with pytest.raises(DatabaseUnavailable, match=f"127.0.0.1:{port}"):
        await pgserver.ensure_server(settings, tmp_path / "pgdata")
    assert not (tmp_path / "pgdata").exists()


async def test_embedded_server_when_the_default_does_not_answer(tmp_path):
    settings = settings_for(f"postgresql://postgres@127.0.0.1:{unused_port()}/yuxi",
                            explicit=False)
    started = time.monotonic()
    url, server = await pgserver.ensure_server(settings, tmp_path / "pgdata")
    try:
        assert server is not None
        assert time.monotonic() - started < 30
        assert psycopg.conninfo.conninfo_to_dict(url)["dbname"] == "yuxi"
        assert await schema.ensure_database(url)  # created on the embedded server
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        # Password logins only, with the generated secret beside the data.
        params = psycopg.conninfo.conninfo_to_dict(url)
        secret = pgserver.secret_path(tmp_path / "pgdata")
        assert params["password"] == secret.read_text() and secret.stat().st_mode & 0o077 == 0
        without = psycopg.conninfo.make_conninfo(**{**params, "password": None})
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(without).close()
    finally:
        pgserver.stop_server(server)
    assert not pgserver.server_answers(url)
