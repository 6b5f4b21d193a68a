"""The terminal client's pieces without a server: SSE frames (durable events
with `id:`, ephemeral `message.delta` without), the status line, and a
streamed message followed by its durable copy."""

from __future__ import annotations

import io
import uuid

from yuxi.client import Delta, Event, Slots, Tree, TreeMember, _SseParser
from yuxi.terminal import Screen, describe, status_line


def feed(lines: list[str]):
    parser = _SseParser()
    return [item for line in lines if (item := parser.feed(line)) is not None]


def test_durable_and_ephemeral_frames():
    sid = uuid.uuid4()
    items = feed([
        ": connected", "retry: 1000", "",
        "id: 7", 'data: {"seq": 7, "type": "message", "session_id": "%s", "turn_id": null,' % sid,
        'data: "run_id": null, "data": {"content": "hi"}, "created_at": "2030-01-01T00:00:00Z"}',
        "",
        "event: message.delta", 'data: {"session_id": "%s", "delta": "h"}' % sid, "",
        'data: {"type": "message.delta", "data": {"text": "i"}}', "",
        ": keepalive", "",
    ])
    assert isinstance(items[0], Event) and items[0].seq == 7 and items[0].session_id == sid
    assert describe(items[0]) == "assistant: hi"
    assert [type(i) for i in items[1:]] == [Delta, Delta]
    assert [i.text for i in items[1:]] == ["h", "i"]
    assert all(i.type == "message.delta" for i in items[1:])


def test_status_line_counts_members_and_slots():
    def member(path: str, status: str, queued: int = 0) -> TreeMember:
        return TreeMember(id=uuid.uuid4(), parent_id=None, name=path, path=path, title=None,
                          status=status, current_turn_id=None,
                          queue={"length": queued, "paused": False})
    tree = Tree(tree_id=uuid.uuid4(), slots=Slots(capacity=4, held=3, waiting=1), sessions=[
        member("/root", "waiting"), member("/root/a", "running", queued=2),
        member("/root/b", "running"), member("/root/c", "waiting_user"), member("/root/d", "idle")])
    assert status_line(tree) == ("[5 members: 2 running, 2 waiting, 2 queued | slots 3/4, "
                                 "1 waiting for one]")


def test_streamed_text_then_lines():
    out = io.StringIO()
    screen = Screen(out)
    screen.stream("Hel")
    screen.stream("lo")
    screen.line("· turn completed")
    assert out.getvalue() == "assistant: Hello\n· turn completed\n"
