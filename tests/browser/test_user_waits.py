"""Approvals and questions in a real browser: the answer request fails once
(an intercepted 503); the choices stay, the pending state ends, and Retry
sends them; the turn then resumes with them."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.browser.conftest import create_agent, create_session, shot
from tests.browser.test_workspace import log_of, open_session


def fail_first_answer(page) -> list[str]:
    """Answer requests: the first gets a 503 from the 'proxy', the next go through."""
    seen: list[str] = []

    def handle(route):
        seen.append(route.request.post_data or "")
        if len(seen) == 1:
            route.fulfill(status=503, content_type="application/json",
                          body='{"code": "unavailable", "message": "try again", "errors": []}')
        else:
            route.continue_()

    page.route("**/api/turns/*/answer", handle)
    return seen


def test_approval_retry_after_a_503(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, {"model": "replay", "tools": ["cooperation"], "replay": {"default": [
            {"call": [{"tool": "create_session", "args": {"name": "helper", "task": "hi"}}]},
            {"say": "approved and done"}]}}, name="confirming")
        session = create_session(http, agent["id"], title="Approvals", approval_mode="confirm")
    page = new_page()
    seen = fail_first_answer(page)
    ws = open_session(page, stack, session["id"])
    ws.get_by_label("Message").fill("make a helper")
    ws.get_by_role("button", name="Send").click()
    card = ws.get_by_role("region", name="Approval needed")
    expect(card).to_contain_text("create_session", timeout=15000)
    expect(ws.get_by_role("button", name="Cooperation status")).to_contain_text("1 waiting for you")
    card.get_by_role("button", name="Approve").click()
    alert = card.get_by_role("alert")
    expect(alert).to_contain_text("try again")
    # The decision is kept, nothing is pending any more, and Retry is offered.
    expect(card.get_by_role("button", name="Approve")).to_have_attribute("aria-pressed", "true")
    expect(card.get_by_role("button", name="Approve")).to_be_enabled()
    expect(card.get_by_role("status")).to_have_count(0)
    shot(page, "approval-retry")
    alert.get_by_role("button", name="Retry").click()
    expect(log_of(ws).get_by_text("approved and done")).to_be_visible(timeout=20000)
    expect(card).to_have_count(0)
    assert len(seen) == 2 and seen[0] == seen[1] and '"approve":true' in seen[1].replace(" ", "")
    assert not page.errors


def test_question_retry_keeps_the_choices(stack, new_page):
    with stack.http() as http:
        agent = create_agent(http, {"model": "replay", "tools": ["ask_user"], "replay": {"default": [
            {"call": [{"tool": "ask_user", "args": {"questions": [
                {"id": "color", "question": "Which colour?", "options": ["red", "blue"]},
                {"id": "extras", "question": "Which extras?", "options": ["nuts", "cream"],
                 "multi_select": True, "allow_other": True}]}}]},
            {"say": "colour {{ last.answers.color }}, extras {{ last.answers.extras|join('+') }}"}]}},
            name="asking")
        session = create_session(http, agent["id"], title="Questions")
    page = new_page()
    seen = fail_first_answer(page)
    ws = open_session(page, stack, session["id"])
    ws.get_by_label("Message").fill("ask me")
    ws.get_by_role("button", name="Send").click()
    card = ws.get_by_role("form", name="Questions")
    colour = card.get_by_role("group", name="Which colour?")
    extras = card.get_by_role("group", name="Which extras?")
    expect(colour).to_be_visible(timeout=15000)
    colour.get_by_role("radio", name="blue").check()
    extras.get_by_role("checkbox", name="nuts").check()
    extras.get_by_role("checkbox", name="Other").check()
    extras.get_by_label("Other answer").fill("sprinkles")
    card.get_by_role("button", name="Submit answers").click()
    alert = card.get_by_role("alert")
    expect(alert).to_contain_text("try again")
    expect(colour.get_by_role("radio", name="blue")).to_be_checked()
    expect(extras.get_by_role("checkbox", name="nuts")).to_be_checked()
    expect(extras.get_by_label("Other answer")).to_have_value("sprinkles")
    expect(card.get_by_role("button", name="Submit answers")).to_be_enabled()
    shot(page, "questions-retry")
    alert.get_by_role("button", name="Retry").click()
    expect(log_of(ws).get_by_text("colour blue, extras nuts+sprinkles")).to_be_visible(timeout=20000)
    assert len(seen) == 2
    assert not page.errors
