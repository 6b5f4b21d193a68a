"""Users, apps, API keys and agents."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from yuxi import db
from yuxi.domain import Agent, Scope, from_row
from yuxi.errors import Conflict, InvalidRequest, NotFound
from yuxi.runtime.models import UnknownModelError, validate_agent_config
from yuxi.runtime.replay import ReplayScriptError
from yuxi.services.resources import validate_selection

KEY_PREFIX = "yx_"


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


async def _ensure_scope(conn, user: str, app: str) -> Scope:
    if not user.strip() or not app.strip():
        raise InvalidRequest("user and app names must not be blank")
    user_id = (await db.fetch_one(conn, "ensure_user", {"name": user}))["id"]
    app_id = (await db.fetch_one(conn, "ensure_app", {"name": app}))["id"]
    return Scope(user_id=user_id, app_id=app_id)


async def ensure_scope(pool: AsyncConnectionPool, user: str, app: str) -> Scope:
    """The (user, app) scope, created if missing, without minting a key."""
    async with db.transaction(pool) as conn:
        return await _ensure_scope(conn, user, app)


async def create_key(pool: AsyncConnectionPool, user: str, app: str) -> tuple[str, Scope]:
    """Create user and app if needed and a new API key for them. The clear key
    is returned once; only its digest is stored."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    async with db.transaction(pool) as conn:
        scope = await _ensure_scope(conn, user, app)
        await db.execute(
            conn,
            "insert_api_key",
            {**scope.params(), "key_hash": hash_key(key), "key_prefix": key[:8],
             "lifetime_seconds": None},
        )
    return key, scope


async def create_key_for_scope(pool: AsyncConnectionPool, scope: Scope,
                               lifetime_seconds: float) -> str:
    """A new key of an existing scope that stops working after
    `lifetime_seconds` (the web UI's sign-in cookie holds one)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    async with db.transaction(pool) as conn:
        await db.execute(conn, "insert_api_key",
                         {**scope.params(), "key_hash": hash_key(key), "key_prefix": key[:8],
                          "lifetime_seconds": lifetime_seconds})
    return key


async def revoke_key(pool: AsyncConnectionPool, key: str) -> None:
    async with db.transaction(pool) as conn:
        await db.execute(conn, "revoke_api_key", {"key_hash": hash_key(key)})


async def authenticate(pool: AsyncConnectionPool, key: str) -> Scope | None:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "authenticate", {"key_hash": hash_key(key)})
    return Scope(user_id=row["user_id"], app_id=row["app_id"]) if row else None


def check_agent_config(config: dict[str, Any]) -> None:
    if "resources" in config:
        validate_selection(config["resources"])
    try:
        validate_agent_config(config)
    except (UnknownModelError, ReplayScriptError) as exc:
        raise InvalidRequest(
            str(exc), errors=[{"field": "config", "message": str(exc)}]
        ) from exc


async def create_agent(
    pool: AsyncConnectionPool, scope: Scope, name: str, config: dict[str, Any],
    *, replace: bool = False,
) -> Agent:
    if not name.strip():
        raise InvalidRequest("agent name must not be blank",
                             errors=[{"field": "name", "message": "must not be blank"}])
    check_agent_config(config)
    query = "upsert_agent" if replace else "insert_agent"
    async with pool.connection() as conn:
        try:
            row = await db.fetch_one(
                conn, query, {**scope.params(), "name": name, "config": Jsonb(config)}
            )
        except Exception as exc:
            if getattr(exc, "sqlstate", None) == "23505":
                raise Conflict(f"an agent named {name!r} already exists") from exc
            raise
    return from_row(Agent, row)


async def list_agents(pool: AsyncConnectionPool, scope: Scope) -> list[Agent]:
    async with pool.connection() as conn:
        rows = await db.fetch_all(conn, "list_agents", scope.params())
    return [from_row(Agent, r) for r in rows]


async def get_agent(pool: AsyncConnectionPool, scope: Scope, agent_id) -> Agent:
    async with pool.connection() as conn:
        row = await db.fetch_one(conn, "get_agent", {**scope.params(), "id": agent_id})
    if row is None:
        raise NotFound(f"agent {agent_id} not found", agent_id=agent_id)
    return from_row(Agent, row)
