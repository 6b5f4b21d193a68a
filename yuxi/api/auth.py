"""Bearer API keys: a key maps to one (user, app) scope."""

from __future__ import annotations

from litestar import Request
from litestar.di import NamedDependency
from litestar.exceptions import NotAuthorizedException

from yuxi.domain import Scope
from yuxi.services import accounts

# The caller's scope, provided to every /api handler that names it.
Caller = NamedDependency[Scope]


async def provide_scope(request: Request) -> Scope:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise NotAuthorizedException("missing bearer API key",
                                     headers={"WWW-Authenticate": "Bearer"})
    scope = await accounts.authenticate(request.app.state.pool, key.strip())
    if scope is None:
        raise NotAuthorizedException("invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return scope
