"""Readiness follows worker heartbeats; the status page renders."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.helpers import client, post_input, session_with_script, wait_for, wait_turn_done
from yuxi import __version__

pytestmark = pytest.mark.e2e


def table_rows(html: str, table_id: str) -> dict[str, int]:
    """status -> count of one table of the status page."""
    match = re.search(rf'<table id="{table_id}">(.*?)</table>', html, re.S)
    assert match, f"no table {table_id}"
    return {s: int(n) for s, n in re.findall(r"<tr><td>([a-z_]+)</td><td>(\d+)</td></tr>",
                                             match.group(1))}


async def test_readyz_waits_for_a_worker_and_status_page_renders(api, start_worker, alice):
    async with httpx.AsyncClient(base_url=api, timeout=10) as anon:
        health = await anon.get("/api/healthz")
        assert health.status_code == 200 and health.json() == {"status": "ok"}

        not_ready = await anon.get("/api/readyz")
        assert not_ready.status_code == 503, not_ready.text
        body = not_ready.json()
        assert body["status"] == "not_ready" and body["workers"] == 0
        assert body["database"] is True

        page = await anon.get("/status")
        assert page.status_code == 200
        assert "workers" in page.text and f"v{__version__}" in page.text

        worker = start_worker()

        async def ready():
            response = await anon.get("/api/readyz")
            return response if response.status_code == 200 else None
        ready_response = await wait_for(ready, 30, "readyz to become 200")
        body = ready_response.json()
        assert body["status"] == "ready" and body["workers"] >= 1 and body["database"] is True

        # Counts on the page follow the facts.
        key, _ = alice
        async with client(api, key) as c:
            session = await session_with_script(c, {"default": [{"say": "ok"}]})
            for text in ("one", "two"):
                receipt = await post_input(c, session["id"], text, mode="queue")
                await wait_turn_done(c, receipt["turn_id"])

        page = await anon.get("/status")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        html = page.text
        assert html.lstrip().lower().startswith("<!doctype html>")
        assert f"v{__version__}" in html
        assert re.search(r"Workers with a fresh heartbeat: [1-9]", html), html
        assert table_rows(html, "sessions") == {"idle": 1}
        assert table_rows(html, "turns") == {"completed": 2}
        assert table_rows(html, "runs") == {"completed": 2}

        # A worker that stops gracefully unregisters: not ready again.
        worker.stop()

        async def not_ready_again():
            response = await anon.get("/api/readyz")
            return response if response.status_code == 503 else None
        body = (await wait_for(not_ready_again, 15, "readyz to become 503")).json()
        assert body["workers"] == 0 and body["status"] == "not_ready"
