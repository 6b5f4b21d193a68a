"""Health endpoints and the status page at `/status`."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.response import Response, Template

from yuxi import __version__, db
from yuxi.metrics import CONTENT_TYPE_LATEST
from yuxi.api.errors import RETRY_AFTER_SECONDS

WORKER_FRESH_SECONDS = 30


async def _worker_count(request: Request) -> int:
    async with request.app.state.pool.connection() as conn:
        row = await db.fetch_one(conn, "fresh_workers", {"seconds": WORKER_FRESH_SECONDS})
    return int(row["n"])


@get("/api/healthz", operation_id="healthz", tags=["health"])
async def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@get("/api/readyz", operation_id="readyz", tags=["health"])
async def readyz(request: Request) -> Response[dict[str, Any]]:
    """The database answers and at least one worker heartbeat is fresh."""
    try:
        workers = await _worker_count(request)
        database = True
    except Exception:
        workers, database = 0, False
    ready = database and workers > 0
    body: dict[str, Any] = {"status": "ready" if ready else "not_ready", "database": database,
                            "workers": workers, "listener": request.app.state.hub.connected}
    headers = {}
    if not ready:
        # Also the one error shape (code, message, errors).
        body.update(code="database_unavailable" if not database else "no_worker",
                    message="the database is unavailable" if not database
                    else "no worker has a fresh heartbeat", errors=[])
        if not database:
            headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return Response(body, status_code=200 if ready else 503, headers=headers)


@get("/metrics", operation_id="metrics", include_in_schema=False)
async def metrics(request: Request) -> Response[bytes]:
    """Prometheus text format: this process's figures and the database's
    (yuxi.metrics; no key: expose it to your monitoring network only)."""
    state = request.app.state
    body = await state.metrics.render(state.pool, state.feeds)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@get("/status", operation_id="statusPage", include_in_schema=False)
async def status_page(request: Request) -> Template:
    counts: dict[str, dict[str, int]] = {"sessions": {}, "turns": {}, "runs": {}}
    error = None
    workers = 0
    try:
        async with request.app.state.pool.connection() as conn:
            for row in await db.fetch_all(conn, "status_counts"):
                counts[row["kind"]][row["status"]] = int(row["n"])
        workers = await _worker_count(request)
    except Exception as exc:
        error = str(exc)
    return Template(
        status_code=200 if error is None else 503,
        template_name="status.html",
        context={"version": __version__, "database_ok": error is None, "error": error,
                 "workers": workers, "counts": counts,
                 "listener": request.app.state.hub.connected},
    )
