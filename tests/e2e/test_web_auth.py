"""Sign-in of the web UI: the key is exchanged for an HttpOnly,
SameSite=Strict cookie holding a minted key of the same scope; cookie
requests that change state need the CSRF header (double submit); signing
out revokes the cookie's key; bearer keys are unchanged."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import create_agent, ok

pytestmark = pytest.mark.e2e


async def test_cookie_sign_in_csrf_and_sign_out(api, alice, mallory):
    key, _ = alice
    async with httpx.AsyncClient(base_url=api, timeout=10) as browser:
        # No header: a cross-site form cannot sign a victim in.
        r = await browser.post("/api/auth/session", json={"key": key})
        assert r.status_code == 403 and r.json()["code"] == "csrf_failed"
        r = await browser.post("/api/auth/session", json={"key": "yx_wrong"},
                               headers={"X-Yuxi-CSRF": "x"})
        assert r.status_code == 401 and set(r.json()) == {"code", "message", "errors"}
        r = await browser.post("/api/auth/session", json={"nope": 1}, headers={"X-Yuxi-CSRF": "x"})
        assert r.status_code == 422
        r = await browser.post("/api/auth/session", json={"key": key},
                               headers={"X-Yuxi-CSRF": "x"})
        assert r.status_code == 200, r.text
        cookies = r.headers.get_list("set-cookie")
        session = next(c for c in cookies if c.startswith("yuxi_session="))
        csrf = next(c for c in cookies if c.startswith("yuxi_csrf="))
        assert "HttpOnly" in session and "samesite=strict" in session.lower()
        assert "HttpOnly" not in csrf and "samesite=strict" in csrf.lower()
        minted = session.split(";")[0].split("=", 1)[1]
        assert minted != key and key not in r.text
        token = browser.cookies["yuxi_csrf"]

        ok(await browser.get("/api/auth/session"))
        assert ok(await browser.get("/api/sessions"))["items"] == []
        # State-changing cookie requests need the header equal to the cookie.
        body = {"name": "a", "config": {"model": "replay"}}
        r = await browser.post("/api/agents", json=body)
        assert r.status_code == 403 and r.json()["code"] == "csrf_failed"
        r = await browser.post("/api/agents", json=body, headers={"X-Yuxi-CSRF": "forged"})
        assert r.status_code == 403
        ok(await browser.post("/api/agents", json=body, headers={"X-Yuxi-CSRF": token}), 201)

        # The cookie sees exactly the key's scope.
        async with httpx.AsyncClient(base_url=api, timeout=10,
                                     headers={"Authorization": f"Bearer {mallory[0]}"}) as other:
            theirs = await create_agent(other, {"model": "replay"})
            s = ok(await other.post("/api/sessions", json={"agent_id": theirs["id"]}), 201)
        assert (await browser.get(f"/api/sessions/{s['id']}")).status_code == 404
        assert (await browser.get(f"/api/sessions/{s['id']}/events")).status_code == 404

        r = await browser.delete("/api/auth/session")
        assert r.status_code == 403
        ok(await browser.delete("/api/auth/session", headers={"X-Yuxi-CSRF": token}))
        assert (await browser.get("/api/auth/session")).status_code == 401
    # The minted key is revoked, not just forgotten by the browser.
    async with httpx.AsyncClient(base_url=api, timeout=10,
                                 headers={"Authorization": f"Bearer {minted}"}) as stolen:
        assert (await stolen.get("/api/sessions")).status_code == 401
    # Bearer keys need no CSRF header.
    async with httpx.AsyncClient(base_url=api, timeout=10,
                                 headers={"Authorization": f"Bearer {key}"}) as program:
        ok(await program.post("/api/agents", json={**body, "name": "b"}), 201)
        models = ok(await program.get("/api/models"))
        assert {"id": "replay", "provider": "replay"} in models["items"]


async def test_ui_is_served_at_root_and_client_routes(api):
    async with httpx.AsyncClient(base_url=api, timeout=10) as anon:
        for path in ("/", "/sessions/0b5e6c1e-7a52-4b7e-9a0c-1d2e3f405162"):
            page = await anon.get(path)
            assert page.status_code == 200 and '<div id="app">' in page.text
            assert "https://" not in page.text  # nothing from a CDN
        script = await anon.get("/assets/app.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert "https://cdn" not in script.text and "unpkg" not in script.text
        assert (await anon.get("/static/app.css")).status_code == 200
        assert (await anon.get("/api/models")).status_code == 401


async def test_the_minted_key_expires_with_its_cookie(api, alice, pg):
    # A browser that never signs out must not leave a key that works forever:
    # the minted key's row expires when the cookie does (Max-Age).
    from yuxi.api.web import COOKIE_MAX_AGE
    from yuxi.services.accounts import hash_key

    async with httpx.AsyncClient(base_url=api, timeout=10) as browser:
        ok(await browser.post("/api/auth/session", json={"key": alice[0]},
                              headers={"X-Yuxi-CSRF": "x"}))
        minted = browser.cookies["yuxi_session"]
    left = pg.scalar("SELECT extract(epoch FROM expires_at - now()) FROM yuxi.api_keys"
                     " WHERE key_hash = %s", (hash_key(minted),))
    assert COOKIE_MAX_AGE - 60 < left <= COOKIE_MAX_AGE
    # The key the user signed in with (an API key) does not expire.
    assert pg.scalar("SELECT expires_at FROM yuxi.api_keys WHERE key_hash = %s",
                     (hash_key(alice[0]),)) is None
