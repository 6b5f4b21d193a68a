"""Authentication: a bearer API key, or the browser's session cookie.

A key maps to one (user, app) scope. Programs send `Authorization: Bearer
<key>`. The web UI signs in once (`POST /api/auth/session` with the key):
the server checks the key and mints a *new* key of the same scope that lives
only in an HttpOnly, SameSite=Strict cookie (`yuxi_session`), so the page's
JavaScript never holds a key after sign-in; signing out revokes that minted
key, and it expires with its cookie (api_keys.expires_at) when nobody does. Cookie-authenticated requests that change state must repeat the
`yuxi_csrf` cookie (readable by the page, SameSite=Strict) in the
`X-Yuxi-CSRF` header (double submit): a cross-site page can neither read the
cookie nor send the header.

A process remembers a valid key's scope for KEY_CACHE_SECONDS: a request
then costs no database round trip for authentication. A key revoked in the
database (api_keys.revoked_at) stops working within that time (at once in
the process that revoked it).
"""

from __future__ import annotations

import hmac
import time

from litestar import Request
from litestar.di import NamedDependency
from litestar.exceptions import NotAuthorizedException

from yuxi.domain import Scope
from yuxi.errors import PermissionDenied
from yuxi.services import accounts

# The caller's scope, provided to every /api handler that names it.
Caller = NamedDependency[Scope]

SESSION_COOKIE = "yuxi_session"
CSRF_COOKIE = "yuxi_csrf"
CSRF_HEADER = "x-yuxi-csrf"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

KEY_CACHE_SECONDS = 10.0
KEY_CACHE_SIZE = 10_000

_clock = time.monotonic  # tests move it


class KeyCache(dict[bytes, tuple[Scope, float]]):
    """key hash -> (scope, clock time until which it is trusted), valid keys
    only; one per application (app.state.key_cache)."""


class CsrfRejected(PermissionDenied):
    """A cookie-authenticated request that changes state lacks the CSRF header."""

    code = "csrf_failed"


def check_csrf(request: Request) -> None:
    """Double submit: the header must equal the CSRF cookie."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    header = request.headers.get(CSRF_HEADER, "")
    if not cookie or not header or not hmac.compare_digest(cookie, header):
        raise CsrfRejected(f"a signed-in browser request that changes state needs the "
                           f"{CSRF_HEADER} header matching the {CSRF_COOKIE} cookie")


async def scope_of_key(request: Request, key: str) -> Scope | None:
    now, digest = _clock(), accounts.hash_key(key)
    known = (cache := request.app.state.key_cache).get(digest)
    if known is not None and known[1] > now:
        return known[0]
    scope = await accounts.authenticate(request.app.state.pool, key)
    if scope is None:
        cache.pop(digest, None)
        return None
    if len(cache) >= KEY_CACHE_SIZE:
        cache.clear()
    cache[digest] = (scope, now + KEY_CACHE_SECONDS)
    return scope


async def provide_scope(request: Request) -> Scope:
    header = request.headers.get("authorization", "")
    if header:
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise NotAuthorizedException("missing bearer API key",
                                         headers={"WWW-Authenticate": "Bearer"})
        if (scope := await scope_of_key(request, key)) is None:
            raise NotAuthorizedException("invalid API key",
                                         headers={"WWW-Authenticate": "Bearer"})
        return scope
    cookie = request.cookies.get(SESSION_COOKIE)
    if not cookie:
        raise NotAuthorizedException("missing bearer API key or sign-in cookie",
                                     headers={"WWW-Authenticate": "Bearer"})
    if (scope := await scope_of_key(request, cookie)) is None:
        raise NotAuthorizedException("signed out or expired sign-in; sign in again",
                                     headers={"WWW-Authenticate": "Bearer"})
    if request.method not in SAFE_METHODS:
        check_csrf(request)
    return scope
