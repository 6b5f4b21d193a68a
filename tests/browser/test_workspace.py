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
