"""PgBouncer in transaction mode in front of the test database (Debian's
`pgbouncer`, installed by `make setup`): the API and worker send their
queries through it (YUXI_DATABASE_URL) while the connections that need a
session go direct (YUXI_DIRECT_DATABASE_URL: LISTEN, the checkpointer,
Procrastinate). Turns complete, SSE streams them, and PgBouncer's own
statistics show the traffic. Negative: a LISTEN through the pooler hears
nothing, so an API whose listener goes through it streams no event."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.e2e.conftest import free_port
from tests.e2e.helpers import client, has_event, open_stream, post_input, session_with_script

pytestmark = pytest.mark.e2e

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
SCRIPT = {"default": [{"say": "pooled {{ input }}"}]}


@pytest.fixture
def pgbouncer(db_url):
    """A PgBouncer (transaction pooling, 3 server connections) in front of
    the test database; yields its URL for that database."""
    if not os.path.exists(PGBOUNCER):
        pytest.skip("pgbouncer is not installed (make setup installs it on Debian)")
    server = conninfo_to_dict(db_url)
    port = free_port()
    # Readable by the unprivileged user PgBouncer runs as (-u nobody).
    home = Path(tempfile.mkdtemp(prefix="yuxi-pgbouncer-"))
    home.chmod(0o777)
    (home / "users.txt").write_text(f'"{server.get("user", "postgres")}" ""\n')
    (home / "pgbouncer.ini").write_text(f"""[databases]
* = host={server.get("host", "127.0.0.1")} port={server.get("port", 5432)}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {home}/users.txt
admin_users = {server.get("user", "postgres")}
pool_mode = transaction
default_pool_size = 3
max_client_conn = 500
ignore_startup_parameters = extra_float_digits,options
""")
    for f in home.iterdir():
        f.chmod(0o644)
    args = [PGBOUNCER, str(home / "pgbouncer.ini")]
    if os.geteuid() == 0:
        args[1:1] = ["-u", "nobody"]
    log = open(home / "log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = make_conninfo(db_url, port=str(port))
    deadline = time.monotonic() + 10
    while True:
        try:
            psycopg.connect(url, connect_timeout=1).close()
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError((home / "log").read_text())
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()
    shutil.rmtree(home, ignore_errors=True)


def bouncer_stats(url: str, dbname: str) -> dict[str, int]:
    """SHOW STATS of the admin console (simple query protocol: psql)."""
    admin = make_conninfo(url, dbname="pgbouncer")
    out = subprocess.run(["psql", admin, "-AtF", "|", "-c", "SHOW STATS"], capture_output=True,
                         text=True, check=True).stdout
    header = subprocess.run(["psql", admin, "-AF", "|", "-c", "SHOW STATS"], capture_output=True,
                            text=True, check=True).stdout.splitlines()[0].split("|")
    for line in out.splitlines():
        fields = line.split("|")
        if fields[0] == dbname:
            return {k: int(v) for k, v in zip(header[1:], fields[1:]) if v.isdigit()}
    return {}


def test_listen_through_a_transaction_pooler_hears_nothing(pgbouncer, db_url):
    for url, heard in ((db_url, True), (pgbouncer, False)):
        with psycopg.connect(url, autocommit=True) as listener, \
                psycopg.connect(db_url, autocommit=True) as sender:
            listener.execute("LISTEN yuxi_probe")
            sender.execute("NOTIFY yuxi_probe, 'x'")
            got = list(listener.notifies(timeout=1.5, stop_after=1))
            assert bool(got) is heard, url


async def test_api_and_worker_behind_pgbouncer(pgbouncer, db_url, start_api, start_worker,
                                               alice):
    key, _ = alice
    env = {"YUXI_DATABASE_URL": pgbouncer, "YUXI_DIRECT_DATABASE_URL": db_url,
           # Events must come by NOTIFY, not by the keepalive's re-read.
           "YUXI_SSE_KEEPALIVE_SECONDS": "60"}
    start_worker(**env)
    api = start_api(**env)
    dbname = conninfo_to_dict(db_url)["dbname"]
    before = bouncer_stats(pgbouncer, dbname).get("total_xact_count", 0)
    async with client(api, key) as http:
        sessions = [await session_with_script(http, SCRIPT, name=f"a{i}") for i in range(3)]
        for session in sessions:
            async with open_stream(http, session["id"]) as stream:
                receipt = await post_input(http, session["id"], "hello")
                await stream.read_until(has_event("turn.completed", turn_id=receipt["turn_id"]),
                                        timeout=15)
            result = (await http.get(f"/api/turns/{receipt['turn_id']}/result")).json()
            assert result["output"]["text"] == "pooled hello"
    # The API and worker queries went through PgBouncer (3 server connections).
    assert bouncer_stats(pgbouncer, dbname)["total_xact_count"] - before > 20

    # Negative: the listener through the pooler (the direct URL pointing at
    # PgBouncer too) never hears the NOTIFY: the stream gets no event.
    pooled_listener = start_api(**{**env, "YUXI_DIRECT_DATABASE_URL":
                                   make_conninfo(pgbouncer, application_name="listener")})
    async with client(pooled_listener, key) as http:
        session = await session_with_script(http, SCRIPT, name="deaf")
        async with open_stream(http, session["id"]) as stream:
            await stream.read_until(has_event("session.created"), timeout=5)
            receipt = await post_input(http, session["id"], "hello")
            with pytest.raises(AssertionError, match="not met"):
                await stream.read_until(has_event("turn.completed", turn_id=receipt["turn_id"]),
                                        timeout=4)
