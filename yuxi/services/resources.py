"""Resources (knowledge collections, tool groups) and per-(user, app) grants.

Configs hold a selection *intent*: `"all"` (every resource the user is granted
when a run starts) or a list of `"kind:name"`. Nothing about identities or
grants is ever frozen into a snapshot.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.domain import Scope
from yuxi.errors import InvalidRequest, PermissionDenied

KINDS = ("collection", "tool_group")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Resolved(msgspec.Struct, frozen=True):
    kind: str
    name: str
    resource_id: uuid.UUID | None
    granted: bool

    @property
    def ref(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_ref(ref: str) -> tuple[str, str]:
    kind, sep, name = ref.partition(":")
    if not sep or kind not in KINDS or not _NAME.match(name):
        raise InvalidRequest(
            f"resource {ref!r} must be '<kind>:<name>' with kind one of {', '.join(KINDS)}",
            errors=[{"field": "resources", "message": f"bad resource reference {ref!r}"}])
    return kind, name


def validate_selection(selection: Any) -> None:
    """A config's `resources`: "all" or a list of "kind:name" references."""
    if selection == "all":
        return
    if not isinstance(selection, list) or not all(isinstance(r, str) for r in selection):
        raise InvalidRequest(
            "resources must be \"all\" or a list of \"kind:name\" strings",
            errors=[{"field": "resources", "message": "must be \"all\" or a list of strings"}])
    for ref in selection:
        parse_ref(ref)


async def resolve(pool: AsyncConnectionPool, user_id: uuid.UUID, app_id: uuid.UUID,
                  selection: Any) -> list[Resolved]:
    """The selection resolved with the grants current now."""
    async with pool.connection() as conn:
        rows = await db.fetch_all(conn, "resolve_resources", {
            "user_id": user_id, "app_id": app_id, "selection": Jsonb(selection or [])})
    return [Resolved(**r) for r in rows]


def require_all_granted(resolved: list[Resolved]) -> None:
    """An explicit selection whose resource lost its grant stops the run
    before any model call."""
    missing = [r.ref for r in resolved if not r.granted]
    if missing:
        raise PermissionDenied(f"permission denied: no grant for {', '.join(missing)}")


async def create(pool: AsyncConnectionPool, app_id: uuid.UUID, ref: str) -> uuid.UUID:
    kind, name = parse_ref(ref)
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "ensure_resource",
                                   {"app_id": app_id, "kind": kind, "name": name}))["id"]


async def grant(pool: AsyncConnectionPool, scope: Scope, ref: str) -> uuid.UUID:
    kind, name = parse_ref(ref)
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "grant",
                                   {**scope.params(), "kind": kind, "name": name}))["id"]


async def revoke(pool: AsyncConnectionPool, scope: Scope, ref: str) -> bool:
    kind, name = parse_ref(ref)
    async with pool.connection() as conn:
        return (await db.fetch_one(conn, "revoke",
                                   {**scope.params(), "kind": kind, "name": name}))["revoked"]
