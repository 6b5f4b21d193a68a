"""Browser tests: Debian's chromium driven by Playwright for Python against
the real API (uvicorn) and a real `procrastinate worker` on a fresh database.

To keep them quick on small machines, each test module shares one database,
one API, one worker and one browser; every test uses its own sessions.
Screenshots of the main states go to tests/browser/screenshots/ (README).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import psycopg.sql
import pytest
from psycopg.conninfo import make_conninfo

from tests.conftest import TEST_DBNAME
from tests.e2e.conftest import ApiStarter, Proc, free_port
from yuxi import db
from yuxi.cli import api_command, worker_command
from yuxi.services import accounts

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"
WEB_BUNDLE = Path(__file__).resolve().parents[2] / "web" / "dist" / "app.js"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="module")
def module_db_url(postgresql_noproc, request) -> Iterator[str]:
    """A fresh database of this module, cloned from the schema template."""
    exe = postgresql_noproc
    name = f"{TEST_DBNAME}_{request.module.__name__.rsplit('.', 1)[-1]}"[:63]
    admin = make_conninfo(host=exe.host, port=exe.port, user=exe.user, dbname="postgres",
                          password=exe.password or None)
    ident = psycopg.sql.Identifier(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            ident, psycopg.sql.Identifier(exe.template_dbname)))
    yield make_conninfo(host=exe.host, port=exe.port, user=exe.user, dbname=name,
                        password=exe.password or None)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


class Stack:
    """The API and worker processes of a module; `restart_api()` kills the
    API and starts a new one on the same port (SSE clients reconnect)."""

    def __init__(self, db_url: str, tmp: Path) -> None:
        self.db_url, self.tmp = db_url, tmp
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
        self.env.update(YUXI_DATABASE_URL=db_url, YUXI_DATA_DIR=str(tmp / "data"),
                        YUXI_LEASE_SECONDS="2", YUXI_SSE_KEEPALIVE_SECONDS="1",
                        PYTHONUNBUFFERED="1")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.api = self._start_api()
        self.worker = Proc("worker", worker_command([]), self.env, tmp)
        self.procs.append(self.worker)
        self.key, _ = asyncio.run(self._key())

    def _start_api(self) -> Proc:
        proc = Proc(f"api-{len(self.procs)}", api_command("127.0.0.1", self.port), self.env,
                    self.tmp)
        self.procs.append(proc)
        ApiStarter._wait_healthy(proc, self.base)
        return proc

    async def _key(self):
        pool = db.app_pool(self.db_url, max_size=2)
        await pool.open(wait=True)
        try:
            return await accounts.create_key(pool, "alice", "web")
        finally:
            await pool.close()

    def restart_api(self, down_seconds: float = 0.0) -> None:
        self.api.kill9()
        time.sleep(down_seconds)
        self.api = self._start_api()

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.key}"},
                            timeout=10)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def stack(module_db_url, tmp_path_factory) -> Iterator[Stack]:
    if not WEB_BUNDLE.exists():
        pytest.fail("web/dist/app.js is missing: run `make setup` (npm ci + the web build)")
    s = Stack(module_db_url, tmp_path_factory.mktemp("browser"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is missing: `make setup` installs it (apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def shot(page, name: str) -> Path:
    """A screenshot of the page's main state, kept for people to look at."""
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def sign_in(page, base: str, key: str) -> None:
    page.goto(base + "/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("navigation", name="Sessions").wait_for()


def create_agent(http: httpx.Client, config: dict, name: str = "agent") -> dict:
    r = http.post("/api/agents", json={"name": name, "config": config})
    assert r.status_code == 201, r.text
    return r.json()


def create_session(http: httpx.Client, agent_id: str, **extra) -> dict:
    r = http.post("/api/sessions", json={"agent_id": agent_id, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def wait_until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def signed_in_state(stack, browser) -> dict:
    """The cookies of one sign-in through the form (reused by every page)."""
    context = browser.new_context()
    page = context.new_page()
    sign_in(page, stack.base, stack.key)
    state = context.storage_state()
    context.close()
    return state


class PageErrors(list):
    """Uncaught page errors (a test ends with none)."""


@pytest.fixture
def new_page(browser, signed_in_state):
    """new_page(width=1280, scheme='light') -> a signed-in page."""
    contexts = []

    def make(width: int = 1280, height: int = 800, scheme: str = "light", signed_in=True):
        context = browser.new_context(viewport={"width": width, "height": height},
                                      color_scheme=scheme,
                                      storage_state=signed_in_state if signed_in else None)
        contexts.append(context)
        page = context.new_page()
        page.errors = PageErrors()
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        return page

    yield make
    for context in contexts:
        context.close()
