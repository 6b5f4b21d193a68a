"""A model's commands do not reach the control plane (docs/sandbox.md).

Each escape of the issue that found them is tried through `run_command`
by a real worker: confined (the default) it fails; with the operator's
opt-out `YUXI_SANDBOX=host` the same probe succeeds, which proves each test
can fail. Mallory's tree holds a private input and a private file; alice's
agent is the one probing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import (client, create_agent, create_session, ok, post_input,
                               result_of, wait_turn_done)
from yuxi.services import resources

pytestmark = pytest.mark.e2e

CHECKOUT = Path(__file__).resolve().parents[2]
PROVIDER_KEY = "sk-test-provider-key-4242"
MALLORY_INPUT = "mallory's private input 7731"
MALLORY_FILE = "mallory's private file 9917"
# Every command's output is the answer.
SCRIPT = {"default": [{"call": [{"tool": "run_command", "args": {"command": "{{ input }}"}}]},
                      {"say": "exit={{ last.exit_code }}\n{{ last.output }}"}]}
MODES = [pytest.param("bwrap", id="confined"), pytest.param("host", id="host-negative")]


class Stack:
    """One worker (in `mode`) and the API; alice and mallory each have a
    session of a sandbox agent."""

    def __init__(self, api: str, db_url: str, data_dir: Path, keys: dict) -> None:
        self.api, self.db_url, self.data_dir, self.keys = api, db_url, data_dir, keys
        self.sessions: dict[str, dict] = {}

    async def setup(self, pool) -> None:
        for who, (key, scope) in self.keys.items():
            await resources.create(pool, scope.app_id, "tool_group:sandbox")
            await resources.grant(pool, scope, "tool_group:sandbox")
            async with client(self.api, key) as http:
                agent = await create_agent(http, {
                    "model": "replay", "replay": SCRIPT, "resources": ["tool_group:sandbox"],
                    "tools": ["run_command"]})
                self.sessions[who] = await create_session(http, agent["id"])
        # Mallory's secrets: an input in the database, a file in her workdir.
        assert await self.run("mallory", f"echo {MALLORY_FILE!r} > private.txt; "
                                          f": {MALLORY_INPUT!r}")

    async def run(self, who: str, command: str) -> str:
        """The command's output (after an `exit=N` line)."""
        async with client(self.api, self.keys[who][0]) as http:
            receipt = await post_input(http, self.sessions[who]["id"], command)
            turn = await wait_turn_done(http, receipt["turn_id"], timeout=40)
            result = await result_of(http, receipt["turn_id"])
        assert turn["status"] == "completed", result["error"]
        return result["output"]["text"]

    def mallory_workdir(self) -> Path:
        return self.data_dir / "workdirs" / self.sessions["mallory"]["tree_id"]


@pytest.fixture
async def stack(request, start_worker, api, alice, mallory, pool, db_url, data_dir):
    worker = start_worker(YUXI_SANDBOX=request.param, OPENAI_API_KEY=PROVIDER_KEY)
    s = Stack(api, db_url, data_dir, {"alice": alice, "mallory": mallory})
    s.worker = worker
    await s.setup(pool)
    s.confined = request.param == "bwrap"
    return s


def expect(stack: Stack, reached: bool, output: str) -> None:
    """Confined: not reached. Host (the negative): reached."""
    assert reached == (not stack.confined), output


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_the_environment_holds_no_secret(stack):
    output = await stack.run("alice", "env")
    expect(stack, "YUXI_DATABASE_URL=" in output or PROVIDER_KEY in output, output)
    # The opt-out is said at the worker's startup.
    assert ("UNCONFINED" in stack.worker.log()) == (not stack.confined)
    if stack.confined:
        names = {line.split("=", 1)[0] for line in output.splitlines()[1:] if "=" in line}
        assert names <= {"PATH", "HOME", "TMPDIR", "TERM", "USER", "PWD", "SHLVL", "LANG",
                         "OLDPWD", "_"} | {n for n in names if n.startswith("LC_")}, names


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_the_database_is_unreachable_by_url_and_by_default_host(stack):
    by_url = await stack.run("alice", f"psql '{stack.db_url}' -Atc "
                                      "'select content from yuxi.inputs' 2>&1")
    expect(stack, MALLORY_INPUT in by_url, by_url)
    dbname = stack.db_url.rsplit("dbname=", 1)[1].split()[0]
    for host in ("127.0.0.1", "/var/run/postgresql"):
        listing = await stack.run("alice", f"psql -h {host} -U postgres -Atl 2>&1")
        expect(stack, dbname in listing, listing)
    # Below psql: not even a TCP connection to the server's port.
    tcp = await stack.run("alice", "python3 -c \"import socket; "
                                   "socket.create_connection(('127.0.0.1', 5432), 2); "
                                   "print('CONNECTED')\" 2>&1")
    expect(stack, "CONNECTED" in tcp, tcp)


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_another_trees_workdir_is_out_of_reach(stack):
    path = stack.mallory_workdir() / "private.txt"
    assert MALLORY_FILE in path.read_text()
    output = await stack.run("alice", f"cat {path} 2>&1; ls {stack.data_dir}/workdirs 2>&1")
    expect(stack, MALLORY_FILE in output, output)


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_proc_shows_no_process_of_the_worker(stack):
    output = await stack.run("alice", "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' "
                                      "| grep -c '^YUXI_DATABASE_URL='; "
                                      # [e]: the probe's own command line does not match
                                      "grep -lE 'workers[.]ru[n]|procrastinat[e]' /proc/[0-9]*/cmdline 2>/dev/null "
                                      "| wc -l")
    environs, workers = (int(n) for n in output.splitlines()[1:3])
    expect(stack, environs > 0 and workers > 0, output)


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_the_host_api_port_does_not_answer(stack):
    output = await stack.run("alice", "python3 -c \"import sys, urllib.request; "
                                      "print('STATUS', urllib.request.urlopen(sys.argv[1], "
                                      f"timeout=3).status)\" {stack.api}/api/healthz 2>&1")
    expect(stack, "STATUS 200" in output, output)


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_the_checkout_is_invisible(stack):
    output = await stack.run("alice", f"cat {CHECKOUT}/pyproject.toml 2>&1; ls /root 2>&1")
    expect(stack, 'name = "yuxi-sessions"' in output, output)


@pytest.mark.parametrize("stack", MODES, indirect=True)
async def test_commands_hold_no_capability_or_privilege(stack):
    output = await stack.run("alice", "id -u; grep -E '^(CapEff|CapPrm|NoNewPrivs)' "
                                      "/proc/self/status")
    privileged = "CapEff:\t0000000000000000" not in output or output.splitlines()[1] == "0"
    expect(stack, privileged, output)
    if stack.confined:
        assert output.splitlines()[1:] == ["1000", "CapPrm:\t0000000000000000",
                                           "CapEff:\t0000000000000000", "NoNewPrivs:\t1"]
