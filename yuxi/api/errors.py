"""The one place that maps domain errors to HTTP responses.

Every error body is `{"code": <machine-readable>, "message": <text>, "errors":
[...field errors...]}`.
"""

from __future__ import annotations

import logging
import re

from typing import Any

import msgspec
import psycopg
from litestar import Controller, MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import ResponseSpec

from yuxi import errors

log = logging.getLogger(__name__)

# Seconds a client should wait before retrying a 503 database_unavailable.
RETRY_AFTER_SECONDS = 2

STATUS: dict[type[errors.YuxiError], int] = {
    errors.NotFound: 404,
    errors.InvalidRequest: 422,
    errors.IllegalTransition: 409,
    errors.Conflict: 409,
    errors.PermissionDenied: 403,
    errors.LeaseLost: 409,
    errors.DatabaseUnavailable: 503,
}

HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 406: "not_acceptable", 409: "conflict",
              413: "payload_too_large", 415: "unsupported_media_type",
              422: "validation_error", 429: "too_many_requests", 500: "internal_error",
              503: "unavailable"}


def _body(code: str, message: str, field_errors: list | None = None) -> dict:
    return {"code": code, "message": message, "errors": field_errors or []}


def _unavailable(message: str) -> Response:
    return Response(_body("database_unavailable", message), status_code=503,
                    media_type=MediaType.JSON,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def domain_error(_: Request, exc: errors.YuxiError) -> Response:
    if isinstance(exc, errors.DatabaseUnavailable):
        return _unavailable(exc.message)
    status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 500)
    return Response(_body(exc.code, exc.message, getattr(exc, "errors", None)),
                    status_code=status, media_type=MediaType.JSON)


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][\w]*)")


def _field_of(error: dict) -> str | None:
    """The body field an error is about: msgspec reports the whole body
    (`data`) for an unknown field and names the field in its message."""
    message = str(error.get("message", ""))
    if m := _UNKNOWN_FIELD.search(message) or _AT_FIELD.search(message):
        return m.group(1)
    return error.get("key")


def validation_error(_: Request, exc: ValidationException) -> Response:
    extra = exc.extra if isinstance(exc.extra, list) else []
    field_errors = [
        {"field": _field_of(e), "message": e.get("message"), "source": e.get("source")}
        for e in extra if isinstance(e, dict)
    ]
    return Response(_body("validation_error", exc.detail, field_errors),
                    status_code=422, media_type=MediaType.JSON)


def http_error(_: Request, exc: HTTPException) -> Response:
    return Response(_body(HTTP_CODES.get(exc.status_code, "error"), exc.detail),
                    status_code=exc.status_code, media_type=MediaType.JSON,
                    headers=exc.headers)


def database_error(request: Request, exc: psycopg.Error) -> Response:
    """A lost or refused database connection (a restart, a failover, an
    outage, no free pooled connection in time) is 503, the client retries;
    any other database error is a bug: 500."""
    if errors.is_connection_error(exc):
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return _unavailable("the database is unavailable; retry later")
    return internal_error(request, exc)


def internal_error(request: Request, exc: Exception) -> Response:
    """Anything unexpected: logged with its traceback, answered in the one
    error shape without internals."""
    if errors.is_connection_error(exc):
        return database_error(request, exc)  # type: ignore[arg-type]
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return Response(_body("internal_error", "internal server error"), status_code=500,
                    media_type=MediaType.JSON)


HANDLERS = {
    errors.YuxiError: domain_error,
    ValidationException: validation_error,
    HTTPException: http_error,
    psycopg.Error: database_error,
    Exception: internal_error,
}


class ErrorBody(msgspec.Struct):
    """The one error shape."""

    code: str
    message: str
    errors: list[dict[str, Any]]


ERROR_RESPONSES = {
    status: ResponseSpec(data_container=ErrorBody, description=description,
                         generate_examples=False)
    for status, description in (
        (400, "Malformed request (e.g. JSON that does not parse)"),
        (401, "Missing or invalid API key"),
        (404, "Not found in your scope"),
        (409, "Illegal state transition or conflict"),
        (413, "Body longer than YUXI_MAX_BODY_BYTES"),
        (422, "Invalid request, with field errors"),
        (500, "Unexpected error (a bug), without internals"),
        (503, "database_unavailable: retry after Retry-After seconds"),
    )
}


def document_errors(handlers: list[Any]) -> list[Any]:
    """Document the one error shape on every route (instead of Litestar's
    default 400 schema, which is not what the handlers above answer)."""
    for handler in handlers:
        if isinstance(handler, type) and issubclass(handler, Controller):
            targets = [v for v in vars(handler).values() if isinstance(v, HTTPRouteHandler)]
        elif isinstance(handler, HTTPRouteHandler):
            targets = [handler]
        else:
            continue
        for target in targets:
            target.responses = {**ERROR_RESPONSES, **(target.responses or {})}
    return handlers
