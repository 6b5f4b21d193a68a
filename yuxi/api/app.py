"""The Litestar application: `create_app()` is the ASGI factory
(`uvicorn --factory yuxi.api.app:create_app`, or `yuxi serve`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template import TemplateConfig

from yuxi import __version__, db
from yuxi.heap import freeze_startup_heap
from yuxi.api import errors, events, health, routes, web
from yuxi.api.auth import KeyCache, provide_scope
from yuxi.api.direct import YuxiApp
from yuxi.api.feed import Feeds
from yuxi.api.hub import EventHub
from yuxi.metrics import ApiMetrics
from yuxi.runtime.providers import check_configured
from yuxi.settings import Settings

WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    check_configured()  # a bad YUXI_PROVIDERS stops the process now

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # A request waits at most db_wait_seconds for a connection, then
        # answers 503 database_unavailable (yuxi.api.errors).
        pool = db.app_pool(settings.database_url, prepare=not settings.pooled,
                           timeout=settings.db_wait_seconds)
        checkpoint_pool = db.checkpoint_pool(settings.session_database_url, max_size=4,
                                             timeout=settings.db_wait_seconds)
        hub = EventHub(settings.session_database_url, pool)
        await pool.open()
        await checkpoint_pool.open()
        await hub.start()
        app.state.update(settings=settings, pool=pool, checkpoint_pool=checkpoint_pool, hub=hub,
                         feeds=Feeds(pool, hub, settings),
                         key_cache=KeyCache(), metrics=ApiMetrics())
        freeze_startup_heap()
        try:
            yield
        finally:
            await hub.stop()
            await checkpoint_pool.close()
            await pool.close()

    # YuxiApp: a Litestar app whose SSE frames may skip ASGI (yuxi.api.direct).
    return YuxiApp(
        route_handlers=[
            *errors.document_errors([
                routes.AgentController, routes.SessionController, routes.InputController,
                routes.TurnController, routes.models, events.stream_events, health.healthz,
                health.readyz, web.sign_in, web.who_am_i, web.sign_out]),
            health.status_page, health.metrics, web.index_page, web.session_page,
            create_static_files_router(path="/static", directories=[WEB_DIR / "static"],
                                       include_in_schema=False),
            create_static_files_router(path="/assets", directories=[WEB_DIR / "dist"],
                                       include_in_schema=False),
        ],
        dependencies={"caller": Provide(provide_scope)},
        exception_handlers=errors.HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        template_config=TemplateConfig(directory=WEB_DIR / "templates",
                                       engine=JinjaTemplateEngine),
        openapi_config=OpenAPIConfig(title="Yuxi sessions", version=__version__, path="/schema"),
    )
