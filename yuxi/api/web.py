"""The web UI: the page at `/` and `/sessions/<id>` (client routes), its
sign-in cookie (`/api/auth/session`) and its assets.

The page is `web/index.html`; its script is the bundle `web/dist/app.js`
that `make setup` builds from `web/src` (esbuild, not minified)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import Cookie
from litestar.exceptions import NotAuthorizedException
from litestar.params import FromPath, JSONBody
from litestar.response import File

from yuxi.api.auth import (CSRF_COOKIE, CSRF_HEADER, SESSION_COOKIE, Caller, CsrfRejected,
                           check_csrf, scope_of_key)
from yuxi.services import accounts

WEB_DIR = Path(__file__).resolve().parents[2] / "web"
# A sign-in lasts a working week unless the user signs out first.
COOKIE_MAX_AGE = 7 * 24 * 3600


class SignIn(msgspec.Struct, forbid_unknown_fields=True):
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=500)]


def _page() -> File:
    index = WEB_DIR / "index.html"
    return File(index, content_disposition_type="inline", media_type="text/html",
                headers={"Cache-Control": "no-cache"})


@get("/", include_in_schema=False)
async def index_page() -> File:
    return _page()


@get("/sessions/{session_id:str}", include_in_schema=False)
async def session_page(session_id: FromPath[str]) -> File:
    return _page()


def _cookies(request: Request, key: str, csrf: str, max_age: int) -> list[Cookie]:
    secure = request.url.scheme == "https"
    return [
        Cookie(key=SESSION_COOKIE, value=key, httponly=True, samesite="strict", path="/",
               max_age=max_age, secure=secure),
        Cookie(key=CSRF_COOKIE, value=csrf, httponly=False, samesite="strict", path="/",
               max_age=max_age, secure=secure),
    ]


@post("/api/auth/session", operation_id="signIn", tags=["auth"], status_code=200)
async def sign_in(request: Request, data: JSONBody[SignIn]) -> Response[dict[str, str]]:
    """Exchange an API key for the HttpOnly sign-in cookie of the web UI.
    Needs the `X-Yuxi-CSRF` header (any value: a cross-site form cannot
    send it)."""
    if not request.headers.get(CSRF_HEADER):
        raise CsrfRejected(f"sign-in needs the {CSRF_HEADER} header")
    scope = await scope_of_key(request, data.key.strip())
    if scope is None:
        raise NotAuthorizedException("invalid API key")
    # The minted key expires with its cookie: a browser that never signs out
    # leaves no key that works forever.
    minted = await accounts.create_key_for_scope(request.app.state.pool, scope,
                                                 COOKIE_MAX_AGE)
    csrf = secrets.token_urlsafe(24)
    return Response({"user_id": str(scope.user_id), "app_id": str(scope.app_id)},
                    cookies=_cookies(request, minted, csrf, COOKIE_MAX_AGE))


@get("/api/auth/session", operation_id="whoAmI", tags=["auth"])
async def who_am_i(caller: Caller) -> dict[str, str]:
    """The caller's scope (401 when signed out)."""
    return {"user_id": str(caller.user_id), "app_id": str(caller.app_id)}


@delete("/api/auth/session", operation_id="signOut", tags=["auth"], status_code=200)
async def sign_out(request: Request) -> Response[dict[str, bool]]:
    """Revoke the cookie's key and clear the cookies."""
    key = request.cookies.get(SESSION_COOKIE)
    if key:
        check_csrf(request)
        await accounts.revoke_key(request.app.state.pool, key)
        request.app.state.key_cache.pop(accounts.hash_key(key), None)
    return Response({"signed_out": True}, cookies=_cookies(request, "", "", 0))
