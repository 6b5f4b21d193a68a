"""The session workspace in a real browser (chromium) against the real API
and worker: sign-in, new session, the conversation with steer and queue,
cancel, the status entry and cooperation list, member tabs, maximize,
kept-alive workspaces, observation that recovers by itself, and the layout
at three widths in both colour schemes."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.browser.conftest import create_agent, create_session, shot, wait_until

SLOW = {"model": "replay", "tools": ["echo"], "replay": {"default": [
    {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}], "delay_ms": 2500},
    {"say": "slow said: {{ input }}", "delay_ms": 300}]}}

# A parent that creates two children, waits for both without a slot and
# reports their exact results; anything else is echoed.
COOP = {"model": "replay", "tools": ["cooperation"], "replay": {
    "rules": [
        {"match": "^fan out", "steps": [
            {"call": [
                {"tool": "create_session", "args": {"name": "writer", "title": "Writer",
                                                    "task": "write: {{ input }}"}},
                {"tool": "create_session", "args": {"name": "reviewer", "title": "Reviewer",
                                                    "task": "review: {{ input }}"}}]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
            {"call": [
                {"tool": "get_result", "args": {"input_id": "{{ results[0].input_id }}"}},
                {"tool": "get_result", "args": {"input_id": "{{ results[1].input_id }}"}}]},
            {"say": "parent got: {{ results[3].output.text }} + {{ results[4].output.text }}"}]},
        {"match": "^write: ", "steps": [{"say": "draft by {{ session.path }}", "delay_ms": 2500}]},
        {"match": "^review: ", "steps": [{"say": "review by {{ session.path }}", "delay_ms": 2500}]},
    ],
    "default": [{"say": "You said: {{ input }}", "delay_ms": 200}]}}


def log_of(scope):
    return scope.get_by_role("log", name="Conversation")


def open_session(page, stack, session_id):
    page.goto(f"{stack.base}/sessions/{session_id}")
    ws = page.locator(f'section.workspace[data-root="{session_id}"]')
    expect(ws).to_be_visible()
    expect(ws.locator(".conn")).to_have_text("live")
    return ws


def test_sign_in_form_new_session_and_conversation(stack, new_page):
    with stack.http() as http:
        create_agent(http, SLOW, name="slow")
    page = new_page(signed_in=False)
    page.goto(stack.base + "/")
    page.get_by_label("API key").fill(stack.key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("navigation", name="Sessions")).to_be_visible()
    # The key never reaches the page's script: only an HttpOnly cookie holds a (minted) key.
    assert stack.key not in page.evaluate("document.cookie")
    cookies = {c["name"]: c for c in page.context.cookies()}
    assert cookies["yuxi_session"]["httpOnly"] and cookies["yuxi_session"]["sameSite"] == "Strict"

    page.get_by_role("button", name="New session").click()
    page.get_by_label("Agent").select_option(label="slow")
    expect(page.get_by_label("Model").locator("option", has_text="replay")).to_have_count(1)
    page.get_by_label("Model").select_option("replay")
    page.get_by_label("Approval mode").select_option("auto")
    page.get_by_role("button", name="Create").click()
    page.wait_for_url(re.compile(r"/sessions/[0-9a-f-]{36}$"))
    session_id = page.url.rsplit("/", 1)[1]
    nav = page.get_by_role("navigation", name="Sessions")
    expect(nav.locator(f'a[href="/sessions/{session_id}"]')).to_be_visible()

    ws = page.locator(f'section.workspace[data-root="{session_id}"]')
    expect(ws.get_by_role("radio", name="Steer")).to_be_checked()
    ws.get_by_label("Message").fill("first")
    ws.get_by_role("button", name="Send").click()
    expect(ws.get_by_role("button", name="Cancel turn")).to_be_visible()
    expect(nav.locator(f'a[href="/sessions/{session_id}"] .marker-running')).to_be_visible(timeout=10000)
    # Two queued inputs show with their positions.
    ws.get_by_role("radio", name="Queue").check()
    for text in ("second", "third"):
        ws.get_by_label("Message").fill(text)
        ws.get_by_role("button", name="Send").click()
        expect(ws.get_by_label("Message")).to_have_value("")
    queued = ws.get_by_role("region", name="Queued inputs")
    expect(queued.locator("li")).to_have_text(["#1 second", "#2 third"])
    shot(page, "conversation-queue")
    # Cancel the turn in flight (still in its first model call): the queue
    # goes on with 'second'.
    ws.get_by_role("button", name="Cancel turn").click()
    log = log_of(ws)
    expect(log.get_by_text("Turn cancelled")).to_be_visible(timeout=10000)
    # The tool call is collapsible and shows its result.
    tool = log.locator("details.tool").first
    expect(tool).to_contain_text("echo finished", timeout=10000)
    tool.locator("summary").click()
    expect(tool).to_contain_text('"text": "second"')
    expect(log.get_by_text("slow said: second")).to_be_visible(timeout=20000)
    expect(log.get_by_text("slow said: third")).to_be_visible(timeout=20000)
    expect(log.get_by_text("slow said: first")).to_have_count(0)
    expect(ws.get_by_role("button", name="Cancel turn")).to_have_count(0)
    expect(queued).to_have_count(0)
    assert not page.errors


def test_cooperation_parent_resumes_status_list_member_tabs_and_maximize(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, COOP, name="coop")
        root = create_session(http, agent["id"], title="Cooperation demo")
    page = new_page(width=1280)
    ws = open_session(page, stack, root["id"])
    log = log_of(ws.locator(".main-col"))
    ws.get_by_label("Message").first.fill("fan out now")
    ws.get_by_role("button", name="Send").first.click()
    # While the parent waits on its children, append input (queued): the
    # subscription stays and the parent resumes into the open page.
    expect(ws.get_by_role("button", name="Cooperation status")).to_contain_text("3", timeout=15000)
    ws.get_by_role("radio", name="Queue").first.check()
    ws.get_by_label("Message").first.fill("after the children")
    ws.get_by_role("button", name="Send").first.click()
    expect(ws.get_by_role("region", name="Queued inputs").locator("li")).to_have_text(
        ["#1 after the children"])
    expect(log.get_by_text("parent got: draft by /root/writer + review by /root/reviewer")
           ).to_be_visible(timeout=30000)
    expect(log.get_by_text("You said: after the children")).to_be_visible(timeout=15000)
    expect(ws.locator(".conn")).to_have_text("live")

    # The status entry: count, summary; floating at 1280 px, closed by a click outside.
    ws.get_by_role("button", name="Cooperation status").click()
    panel = ws.get_by_role("region", name="Cooperation status panel")
    expect(panel).to_have_attribute("data-mode", "floating")
    expect(panel).to_contain_text("3 cooperation sessions")
    expect(panel).to_contain_text("nothing needs attention")
    ws.get_by_label("Message").first.click()   # the input stays usable while it floats
    expect(panel).to_have_count(0)
    ws.get_by_role("button", name="Cooperation status").click()
    ws.get_by_role("button", name="Open cooperation list").click()
    tabs = ws.get_by_role("tablist")
    expect(tabs.get_by_role("tab", name="Cooperation")).to_be_visible()
    coop = ws.get_by_role("tabpanel", name="Cooperation")
    for path in ("/root", "/root/writer", "/root/reviewer"):
        expect(coop.get_by_role("button", name=path, exact=True)).to_be_visible()
    expect(coop).to_contain_text("Writer")
    shot(page, "cooperation-list")

    # Member tabs: named by path, reused, closable, with the same abilities.
    coop.get_by_role("button", name="/root/writer", exact=True).click()
    writer = ws.get_by_role("tabpanel", name="/root/writer")
    expect(log_of(writer).get_by_text("draft by /root/writer")).to_be_visible()
    ws.get_by_role("tab", name="Cooperation").click()
    coop.get_by_role("button", name="/root/writer", exact=True).click()
    expect(tabs.get_by_role("tab", name="/root/writer")).to_have_count(1)
    expect(writer.get_by_role("toolbar")).to_have_count(0)
    writer.get_by_label("Message").fill("more from the user")
    writer.get_by_role("button", name="Send").click()
    expect(log_of(writer).get_by_text("You said: more from the user")).to_be_visible(timeout=15000)
    shot(page, "member-tab")
    ws.get_by_role("button", name="Close /root/writer").click()
    expect(tabs.get_by_role("tab", name="/root/writer")).to_have_count(0)

    # Maximize: the main session is the first, non-closable tab; the status
    # entry sits at the outer top-right; Restore brings the split back.
    ws.get_by_role("button", name="Maximize").click()
    first = tabs.get_by_role("tab").first
    expect(first).to_have_text("/root")
    expect(ws.get_by_role("button", name="Close /root", exact=True)).to_have_count(0)
    expect(ws.locator(".ws-bar").get_by_role("button", name="Cooperation status")).to_be_visible()
    expect(log_of(ws.get_by_role("tabpanel", name="/root")).get_by_text("parent got:", exact=False)).to_be_visible()
    shot(page, "maximized")
    ws.get_by_role("button", name="Restore").click()
    expect(ws.locator(".main-col")).to_be_visible()
    expect(tabs.get_by_role("tab", name="/root", exact=True)).to_have_count(0)
    assert not page.errors


def test_status_panel_embeds_when_wide_and_stop_all_and_continue(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, SLOW, name="slow-2200")
        session = create_session(http, agent["id"], title="Wide")
    page = new_page(width=2200, height=1000)
    ws = open_session(page, stack, session["id"])
    ws.get_by_label("Message").fill("busy")
    ws.get_by_role("button", name="Send").click()
    ws.get_by_role("radio", name="Queue").check()
    ws.get_by_label("Message").fill("waits")
    ws.get_by_role("button", name="Send").click()
    ws.get_by_role("button", name="Cooperation status").click()
    panel = ws.get_by_role("region", name="Cooperation status panel")
    expect(panel).to_have_attribute("data-mode", "embedded")
    # Embedded: a click outside does not close it; the input stays usable.
    ws.get_by_label("Message").click()
    expect(panel).to_be_visible()
    box, col = panel.bounding_box(), ws.locator(".main-col .col").bounding_box()
    assert box["x"] >= col["x"] + col["width"], "the embedded panel covers no message"
    shot(page, "status-embedded-2200")
    panel.get_by_role("button", name="Stop all").click()
    banner = ws.locator(".banner.paused")
    expect(banner).to_contain_text("Queue paused", timeout=15000)
    expect(panel.get_by_role("button", name="Stop all")).to_have_count(0)
    shot(page, "queue-paused")
    banner.get_by_role("button", name="Continue queue").click()
    expect(log_of(ws).get_by_text("slow said: waits")).to_be_visible(timeout=20000)
    expect(banner).to_have_count(0)
    assert not page.errors


def test_workspaces_stay_alive_and_background_is_not_marked_read(stack, new_page):
    long_say = {"model": "replay", "replay": {"default": [
        {"say": "{% for i in range(60) %}line {{ i }} of {{ input }}\n{% endfor %}"}]}}
    with stack.http() as http:
        agent = create_agent(http, long_say, name="long")
        a = create_session(http, agent["id"], title="Session A")
        b = create_session(http, agent["id"], title="Session B")
        for s in (a, b):
            r = http.post(f"/api/sessions/{s['id']}/inputs", json={"content": "fill"})
            assert r.status_code == 202
    page = new_page(width=1280)
    nav = page.get_by_role("navigation", name="Sessions")
    ws_a = open_session(page, stack, a["id"])
    expect(log_of(ws_a).get_by_text("line 59 of fill")).to_be_visible(timeout=15000)
    log_a = log_of(ws_a)
    log_a.evaluate("el => { el.scrollTop = 300; el.dispatchEvent(new Event('scroll')); }")
    ws_a.get_by_label("Message").fill("draft of A")
    ws_a.get_by_role("button", name="Cooperation status").click()
    ws_a.get_by_role("button", name="Open cooperation list").click()

    nav.get_by_role("link", name=re.compile("Session B")).click()
    ws_b = page.locator(f'section.workspace[data-root="{b["id"]}"]')
    expect(ws_b).to_be_visible()
    expect(ws_a).to_be_hidden()
    expect(log_of(ws_b).get_by_text("line 59 of fill")).to_be_visible(timeout=15000)
    ws_b.get_by_label("Message").fill("draft of B")
    # A gets a message while in the background: marked unread, not read.
    with stack.http() as http:
        http.post(f"/api/sessions/{a['id']}/inputs", json={"content": "background"})
    expect(nav.get_by_role("link", name=re.compile("Session A")).locator(".marker-unread")
           ).to_be_visible(timeout=15000)

    nav.get_by_role("link", name=re.compile("Session A")).click()
    expect(ws_a).to_be_visible()
    expect(ws_a.get_by_label("Message")).to_have_value("draft of A")
    expect(ws_a.get_by_role("tab", name="Cooperation")).to_be_visible()
    assert abs(log_a.evaluate("el => el.scrollTop") - 300) < 5
    expect(nav.get_by_role("link", name=re.compile("Session A")).locator(".marker-unread")).to_have_count(0)
    nav.get_by_role("link", name=re.compile("Session B")).click()
    expect(ws_b.get_by_label("Message")).to_have_value("draft of B")
    assert not page.errors


def test_session_missing_from_the_first_page_is_loaded_by_id(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, SLOW, name="many")
        old = create_session(http, agent["id"], title="The oldest one")
        for i in range(50):
            create_session(http, agent["id"], title=f"filler {i}")
        first_page = http.get("/api/sessions?limit=50").json()["items"]
    assert old["id"] not in {s["id"] for s in first_page}
    page = new_page()
    open_session(page, stack, old["id"])
    nav = page.get_by_role("navigation", name="Sessions")
    expect(nav.get_by_role("link", name="The oldest one")).to_be_visible()
    expect(page.locator(".ws-title:visible")).to_have_text("The oldest one")


def test_sse_reconnects_without_duplicates_or_gaps(stack, new_page):
    script = {"model": "replay", "tools": ["echo"], "replay": {"default": [
        {"call": [{"tool": "echo", "args": {"text": "one"}}], "delay_ms": 700},
        {"call": [{"tool": "echo", "args": {"text": "two"}}], "delay_ms": 700},
        {"call": [{"tool": "echo", "args": {"text": "three"}}], "delay_ms": 700},
        {"say": "all done after {{ input }}", "delay_ms": 700}]}}
    with stack.http() as http:
        agent = create_agent(http, script, name="steps")
        session = create_session(http, agent["id"], title="Reconnect")
    page = new_page()
    ws = open_session(page, stack, session["id"])
    ws.get_by_label("Message").fill("go")
    ws.get_by_role("button", name="Send").click()
    log = log_of(ws)
    expect(log.locator("details.tool")).to_have_count(1, timeout=10000)
    stack.restart_api(down_seconds=1.0)     # the stream breaks while the run goes on
    expect(log.get_by_text("all done after go")).to_be_visible(timeout=30000)
    expect(ws.locator(".conn")).to_have_text("live")
    expect(log.locator("details.tool")).to_have_count(3)
    expect(log.locator(".msg.user")).to_have_count(1)
    expect(log.get_by_text("all done after go")).to_have_count(1)
    assert not page.errors


WIDTHS = (2200, 1280, 375)


def test_layout_at_three_widths_in_light_and_dark(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, {"model": "replay", "replay": {"default": [
            {"say": "A long answer " + "with-a-very-long-unbroken-word-" * 4 + " that wraps."}]}},
            name="layout")
        session = create_session(http, agent["id"], title="Layout")
        http.post(f"/api/sessions/{session['id']}/inputs", json={"content": "x" * 300})
    for scheme in ("light", "dark"):
        for width in WIDTHS:
            page = new_page(width=width, height=800, scheme=scheme)
            ws = open_session(page, stack, session["id"])
            expect(log_of(ws).get_by_text("A long answer", exact=False)).to_be_visible(timeout=15000)
            ws.get_by_role("button", name="Cooperation status").click()
            panel = ws.get_by_role("region", name="Cooperation status panel")
            expect(panel).to_have_attribute("data-mode", "embedded" if width == 2200 else "floating")
            for target in (ws.get_by_role("button", name="Cooperation status"), ws.get_by_label("Message"),
                           ws.get_by_role("button", name="Send")):
                expect(target).to_be_in_viewport()
            sideways = page.evaluate(
                "() => [document.documentElement.scrollWidth - innerWidth,"
                " ...[...document.querySelectorAll('body *')].filter(e => e.scrollWidth > e.clientWidth + 1"
                " && getComputedStyle(e).overflowX !== 'hidden' && e.getAttribute('role') !== 'tablist'"
                " && getComputedStyle(e).overflowX !== 'visible').map(e => e.className)]")
            assert sideways[0] <= 0 and sideways[1:] == [], (width, scheme, sideways)
            bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert (bg == "rgb(21, 23, 27)") == (scheme == "dark"), bg
            shot(page, f"workspace-{width}-{scheme}")
            page.context.close()
