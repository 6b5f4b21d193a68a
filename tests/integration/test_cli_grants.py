"""`yuxi grants add|revoke` on a real database, as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.integration.helpers import rows

YUXI = str(Path(sys.executable).parent / "yuxi")


def _yuxi(db_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "YUXI_DATABASE_URL": db_url}
    return subprocess.run([YUXI, *args], env=env, capture_output=True, text=True, timeout=60)


async def test_grant_and_revoke(db_url, pool):
    base = ("--user", "op-user", "--app", "op-app", "--resource", "collection:docs")
    done = _yuxi(db_url, "grants", "add", *base)
    assert done.returncode == 0, done.stderr
    live = "SELECT count(*) AS n FROM yuxi.grants WHERE revoked_at IS NULL"
    assert (await rows(pool, live)) == [{"n": 1}]
    assert _yuxi(db_url, "grants", "add", *base).returncode == 0  # idempotent
    assert (await rows(pool, live)) == [{"n": 1}]
    assert _yuxi(db_url, "grants", "revoke", *base).returncode == 0
    assert (await rows(pool, live)) == [{"n": 0}]
    again = _yuxi(db_url, "grants", "revoke", *base)
    assert again.returncode == 1
    assert again.stderr.startswith("yuxi: error:") and "Traceback" not in again.stderr
    bad = _yuxi(db_url, "grants", "add", "--user", "u", "--app", "a", "--resource", "docs")
    assert bad.returncode == 1 and "kind" in bad.stderr
