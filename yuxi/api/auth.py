"""Bearer API keys: a key maps to one (user, app) scope.

A process remembers a valid key's scope for KEY_CACHE_SECONDS: a request
then costs no database round trip for authentication. A key revoked in the
database (api_keys.revoked_at) stops working within that time.
"""

from __future__ import annotations

import time

from litestar import Request
from litestar.di import NamedDependency
from litestar.exceptions import NotAuthorizedException

from yuxi.domain import Scope
from yuxi.services import accounts

# The caller's scope, provided to every /api handler that names it.
Caller = NamedDependency[Scope]


KEY_CACHE_SECONDS = 10.0
KEY_CACHE_SIZE = 10_000

_clock = time.monotonic  # tests move it


class KeyCache(dict[bytes, tuple[Scope, float]]):
    """key hash -> (scope, clock time until which it is trusted), valid keys
    only; one per application (app.state.key_cache)."""


async def provide_scope(request: Request) -> Scope:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise NotAuthorizedException("missing bearer API key",
                                     headers={"WWW-Authenticate": "Bearer"})
    now, digest = _clock(), accounts.hash_key(key)
    known = (cache := request.app.state.key_cache).get(digest)
    if known is not None and known[1] > now:
        return known[0]
    scope = await accounts.authenticate(request.app.state.pool, key)
    if scope is None:
        cache.pop(digest, None)
        raise NotAuthorizedException("invalid API key", headers={"WWW-Authenticate": "Bearer"})
    if len(cache) >= KEY_CACHE_SIZE:
        cache.clear()
    cache[digest] = (scope, now + KEY_CACHE_SECONDS)
    return scope
