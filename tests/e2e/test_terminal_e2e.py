"""The `yuxi` terminal client (chat, tail, tree) as a real binary in a
pseudo-terminal (pexpect) against the real API and worker."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pexpect
import pytest

from tests.e2e.conftest import ApiStarter, Proc, free_port
from tests.e2e.helpers import client, ok, post_input, wait_turn_done
from yuxi.cli import api_command
from yuxi import client as yc

pytestmark = pytest.mark.e2e

YUXI = str(Path(sys.executable).with_name("yuxi"))

SCRIPT = {"model": "replay", "tools": ["echo", "ask_user", "cooperation"],
          "approval_mode": "confirm", "replay": {"rules": [
    {"match": "^spawn", "steps": [
        {"call": [{"tool": "create_session", "args": {"name": "helper", "task": "help"}}]},
        {"say": "spawned {{ last.path }}"}]},
    {"match": "^hello", "steps": [
        {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}]},
        {"say": "echo said: {{ last.text }}"}]},
    {"match": "^slow", "steps": [{"say": "slow answer to: {{ inputs|join(' + ') }}",
                                  "delay_ms": 2500}]},
    {"match": "^wait", "steps": [{"say": "never", "delay_ms": 4000}]},
    {"match": "^ask", "steps": [
        {"call": [{"tool": "ask_user", "args": {"questions": [
            {"id": "color", "question": "Pick a color", "options": ["red", "blue"]}]}}]},
        {"say": "you chose {{ last.answers.color }}"}]},
], "default": [{"say": "You said: {{ input }}"}]}}

ORCHESTRATOR = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
    {"match": "^child", "steps": [{"say": "child done", "delay_ms": 1500}]},
], "default": [
    {"call": [{"tool": "create_session", "args": {"name": "a", "task": "child a"}},
              {"tool": "create_session", "args": {"name": "b", "task": "child b"}}]},
    {"call": [{"tool": "wait_inputs", "args": {
        "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
    {"say": "all done"},
]}}


def _as_in_a_terminal() -> None:
    """The child's Ctrl-C as a terminal's foreground program has it. A
    suite started in the background by a shell without job control (`make
    test &` in a script) ignores SIGINT, and an ignored signal stays ignored
    across exec: the binary would then ignore `sendintr` as such a background
    job should, and the test would wait for an exit that never comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(args: list[str], url: str, key: str, **kw) -> pexpect.spawn:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_URL=url, YUXI_KEY=key, TERM="dumb")
    return pexpect.spawn(YUXI, args, env=env, encoding="utf-8", timeout=30,
                         dimensions=(40, 200), preexec_fn=_as_in_a_terminal, **kw)


def run(args: list[str], url: str, key: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_URL=url, YUXI_KEY=key)
    return subprocess.run([YUXI, *args], env=env, capture_output=True, text=True, timeout=60)


def exit_status(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


async def test_chat_streams_steers_queues_asks_and_cancels(worker, api, alice, pg):
    key, _ = alice
    with yc.Client(api, key) as c:
        c.create_agent("chat", SCRIPT)
    chat = spawn(["chat", "--agent", "chat"], api, key)
    chat.expect(r"session (\S+) \(/root\)")
    sid = chat.match.group(1)

    chat.sendline("hello there")
    chat.expect(r"-> echo\(")
    chat.expect(r"<- echo: ")
    chat.expect("assistant: echo said: hello there")
    chat.expect("turn completed")

    # Enter while a turn runs: a steer, delivered into the same turn.
    chat.sendline("slow one")
    chat.expect("turn started")
    chat.sendline("and more")
    chat.expect("steer sent")
    chat.expect("steer delivered")
    chat.expect("assistant: slow answer to: slow one \\+ and more")
    chat.expect("turn completed")

    # /queue while a turn runs: a turn of its own, after the first.
    chat.sendline("slow two")
    chat.expect("turn started")
    chat.sendline("/queue hello queued")
    chat.expect(r"queued \(position 1\)")
    chat.expect("slow answer to: slow two\r\n")
    chat.expect("echo said: hello queued")

    chat.sendline("/tree")
    chat.expect(r"/root idle")
    chat.expect(r"\[1 members: 0 running, 0 waiting, 0 queued \| slots 0/4\]")

    # A question asked inline.
    chat.sendline("ask me")
    chat.expect(r"\? Pick a color \[red / blue\]")
    chat.sendline("blue")
    chat.expect("answered")
    chat.expect("you chose blue")

    # An approval asked inline.
    chat.sendline("spawn one")
    chat.expect(r"\? approve create_session\(.*\)\? \[y/n\]")
    chat.sendline("y")
    chat.expect("answered")
    chat.expect("spawned /root/helper")

    # Ctrl-C cancels the running turn.
    chat.sendline("wait for it")
    chat.expect("turn started")
    chat.sendintr()
    chat.expect("cancelling the running turn")
    chat.expect("turn cancelled")

    # /stop and /continue.
    chat.sendline("/stop")
    chat.expect("stop: 0 turns cancelled")
    chat.sendline("/continue")
    chat.expect("queue continued")

    # Ctrl-C twice while a turn runs: cancel, then exit (130).
    chat.sendline("wait again")
    chat.expect("turn started")
    chat.sendintr()
    chat.expect("cancelling the running turn")
    chat.sendintr()
    assert exit_status(chat) == 130

    async with client(api, key) as http:
        last = ok(await http.get(f"/api/sessions/{sid}/turns"))[-1]
        await wait_turn_done(http, last["id"], timeout=30)
    turns = pg.rows("SELECT t.status, i.content FROM yuxi.turns t JOIN yuxi.inputs i "
                    "ON i.id = t.input_id WHERE t.session_id = %s ORDER BY t.created_at", (sid,))
    assert [(t["content"], t["status"]) for t in turns] == [
        ("hello there", "completed"), ("slow one", "completed"), ("slow two", "completed"),
        ("hello queued", "completed"), ("ask me", "completed"), ("spawn one", "completed"),
        ("wait for it", "cancelled"), ("wait again", "cancelled")]
    # The steer joined "slow one"'s turn instead of starting one.
    steer = pg.one("SELECT i.turn_id, i.mode FROM yuxi.inputs i WHERE i.session_id = %s "
                   "AND i.content = 'and more'", (sid,))
    first = pg.scalar("SELECT turn_id FROM yuxi.inputs WHERE content = 'slow one' "
                      "AND session_id = %s", (sid,))
    assert steer["mode"] == "steer" and steer["turn_id"] == first


async def test_chat_reconnects_with_last_event_id(worker, alice, proc_env, tmp_path, _procs):
    """The API dies under a connected chat and comes back on the same
    address: the chat resumes its stream after the last event it saw (no
    event twice), and the next turn shows."""
    key, _ = alice
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start_api(n: int) -> Proc:
        proc = Proc(f"api-{n}", api_command("127.0.0.1", port), proc_env, tmp_path)
        _procs.append(proc)
        return proc

    first = start_api(0)
    ApiStarter._wait_healthy(first, url)
    with yc.Client(url, key) as c:
        c.create_agent("chat", SCRIPT)
    chat = spawn(["chat", "--agent", "chat"], url, key)
    chat.logfile_read = io.StringIO()
    chat.expect(r"session (\S+) \(/root\)")
    chat.sendline("hello one")
    chat.expect("echo said: hello one")
    chat.expect("turn completed")

    first.kill9()
    second = start_api(1)
    ApiStarter._wait_healthy(second, url)
    chat.sendline("hello two")
    chat.expect("echo said: hello two")
    chat.expect("turn completed")
    chat.sendline("/quit")
    assert exit_status(chat) == 0
    # Resumed after its cursor: the first turn's events were not replayed.
    transcript = chat.logfile_read.getvalue()
    assert transcript.count("assistant: echo said: hello one") == 1, transcript
    assert transcript.count("turn completed") == 2, transcript


async def test_tail_and_tree(worker, api, alice):
    key, _ = alice
    async with client(api, key) as http:
        agent = ok(await http.post("/api/agents", json={"name": "orch", "config": ORCHESTRATOR}),
                   201)
        session = ok(await http.post("/api/sessions", json={"agent_id": agent["id"]}), 201)
        sid = session["id"]

        tail = spawn(["tail", sid, "--tree"], api, key)
        tail.expect(r"#1 /root · session /root created")
        tail.expect(r"\[1 members: 0 running, 0 waiting, 0 queued \| slots 0/4\]")
        receipt = await post_input(http, sid, "go")
        tail.expect(r"/root\s+-> create_session")
        # Live status: the children are seen running (with the root still
        # running or already waiting: SSE delivers frames in batches, so
        # which intermediate state a status refresh sees depends on timing).
        tail.expect(r"\[3 members: [1-3] running, [01] waiting, 0 queued \| slots [1-4]/4\]")
        tail.expect(r"/root/a · turn completed")
        tail.expect(r"/root · turn completed")
        tail.expect(r"\[3 members: 0 running, 0 waiting, 0 queued \| slots 0/4\]")
        await wait_turn_done(http, receipt["turn_id"])
        tail.sendintr()
        assert exit_status(tail) == 130

    out = run(["tree", sid], api, key)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"/root\s+idle", lines[0])
    assert re.match(r"  /root/a\s+idle", lines[1]) and re.match(r"  /root/b\s+idle", lines[2])
    as_json = json.loads(run(["tree", sid, "--json"], api, key).stdout)
    assert [m["path"] for m in as_json["sessions"]] == ["/root", "/root/a", "/root/b"]
    assert as_json["slots"] == {"capacity": 4, "held": 0, "waiting": 0}

    tail_json = spawn(["tail", sid, "--json"], api, key)
    tail_json.expect(r'\{"seq":1,"type":"session.created"')
    tail_json.sendintr()
    exit_status(tail_json)

    # Errors: a clear message and an exit code per kind.
    bad_key = run(["tree", sid], api, "yx_not_a_key")
    assert bad_key.returncode == 3 and "refused the key" in bad_key.stderr
    unknown = str(uuid.uuid4())
    missing = run(["tail", unknown], api, key)
    assert missing.returncode == 4 and f"session {unknown} not found" in missing.stderr
    down = run(["tree", sid], "http://127.0.0.1:9", key)
    assert down.returncode == 5 and "cannot reach" in down.stderr
    usage = run(["tree", "not-a-uuid"], api, key)
    assert usage.returncode == 2 and "not a session id" in usage.stderr
    no_key = subprocess.run([YUXI, "tree", sid], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("YUXI_")})
    assert no_key.returncode == 2 and "no API key" in no_key.stderr
    no_agent = run(["chat", "--agent", "nobody"], api, key)
    assert no_agent.returncode == 4 and "nobody" in no_agent.stderr


async def test_ctrl_c_reaches_a_tail_while_the_suite_ignores_it(api, alice):
    """The harness guard `_as_in_a_terminal`: with SIGINT ignored in this
    process (the suite run as a background job), a spawned tail still takes
    Ctrl-C as a terminal's foreground program does (without the guard it
    ignores it and never exits)."""
    key, _ = alice
    async with client(api, key) as http:
        agent = ok(await http.post("/api/agents", json={"name": "ignored-sigint",
                                                        "config": SCRIPT}), 201)
        session = ok(await http.post("/api/sessions", json={"agent_id": agent["id"]}), 201)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        tail = spawn(["tail", session["id"]], api, key)
    finally:
        signal.signal(signal.SIGINT, previous)
    tail.expect(r"#1 · session /root created")
    tail.sendintr()
    assert exit_status(tail) == 130
