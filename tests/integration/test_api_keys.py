"""API keys: revoked or expired keys authenticate nobody; a key without an
expiry (an API key) lasts until revoked."""

from __future__ import annotations

from yuxi.services import accounts


async def test_an_expired_key_authenticates_nobody(pool, alice):
    _, scope = alice
    minted = await accounts.create_key_for_scope(pool, scope, 3600)
    assert await accounts.authenticate(pool, minted) == scope
    async with pool.connection() as conn:
        await conn.execute("UPDATE yuxi.api_keys SET expires_at = now() - interval '1 second'"
                           " WHERE key_hash = %s", (accounts.hash_key(minted),))
    assert await accounts.authenticate(pool, minted) is None


async def test_a_key_without_expiry_lasts_until_revoked(pool, alice):
    key, scope = alice
    async with pool.connection() as conn:
        assert await (await conn.execute(
            "SELECT expires_at FROM yuxi.api_keys WHERE key_hash = %s",
            (accounts.hash_key(key),))).fetchone() == {"expires_at": None}
    assert await accounts.authenticate(pool, key) == scope
    await accounts.revoke_key(pool, key)
    assert await accounts.authenticate(pool, key) is None
