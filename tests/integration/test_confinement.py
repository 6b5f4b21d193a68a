"""The confined sandbox through the tools themselves (real bubblewrap, real
PostgreSQL, no worker process): resource limits, fail-closed when bubblewrap
is missing, and what the holder does with its namespaces."""

from __future__ import annotations

import os
import subprocess
import time

import msgspec
import pytest

from tests.integration.helpers import rows
from tests.integration.test_sandbox import _tool_context, at
from yuxi.runtime import confine, sandbox_tools
from yuxi.runtime.tools import ToolError
from yuxi.services import runs, sandbox
from yuxi.settings import Settings


# Forks up to 40 children (each sleeps 3 s, silent) and prints how many it got.
FORKS = """
import os, time
n = 0
for _ in range(40):
    try:
        if os.fork() == 0:
            os.close(1); os.close(2); time.sleep(3); os._exit(0)
        n += 1
    except OSError:
        break
print(n)
"""


def _with(box, **settings):
    return msgspec.structs.replace(box, jail=confine.for_settings(Settings(**settings)))


async def _context(pool, alice, tmp_path, **settings):
    ctx, box = await _tool_context(pool, alice[1], tmp_path)
    box = _with(box, **settings)
    return msgspec.structs.replace(ctx, sandbox=box), box


async def test_a_missing_bubblewrap_refuses_the_tools_with_sandbox_unavailable(
        pool, alice, tmp_path):
    ctx, box = await _context(pool, alice, tmp_path, sandbox_bwrap="/nonexistent/bwrap")
    for tool, args in [(sandbox_tools.run_command, {"command": "echo hi"}),
                       (sandbox_tools.write_file, {"path": "a.txt", "content": "x"}),
                       (sandbox_tools.read_file, {"path": "a.txt"})]:
        with pytest.raises(ToolError) as err:
            await tool(ctx, args)
        assert err.value.code == "sandbox_unavailable"
        assert "bubblewrap" in err.value.message and "YUXI_SANDBOX=host" in err.value.message
    assert not (box.workdir / "a.txt").exists()
    # The negative: with bubblewrap there, the same call runs.
    ctx, box = await _context(pool, alice, tmp_path)
    assert (await sandbox_tools.run_command(ctx, {"command": "echo hi"}))["output"] == "hi\n"


async def test_a_command_is_bounded_in_memory_processes_and_cpu(pool, alice, tmp_path):
    ctx, box = await _context(pool, alice, tmp_path, sandbox_memory_mb=256,
                              sandbox_processes=16, sandbox_cpu_seconds=1)
    memory = await sandbox_tools.run_command(ctx, {
        "command": "python3 -c 'x = bytearray(512 * 1024 * 1024); print(\"ALLOCATED\")' 2>&1"})
    assert "MemoryError" in memory["output"] and "ALLOCATED" not in memory["output"]
    forks = await sandbox_tools.run_command(ctx, {"command": "python3 -c '" + FORKS + "'"})
    assert int(forks["output"]) < 16, forks
    spin = await sandbox_tools.run_command(ctx, {"command": "while :; do :; done",
                                                 "timeout_s": 20})
    # SIGXCPU/SIGKILL after one CPU second, long before the 20 s timeout.
    assert not spin["timed_out"] and spin["exit_code"] != 0
    # The negative: the default limits let the same allocation through.
    ctx, box = await _context(pool, alice, tmp_path)
    memory = await sandbox_tools.run_command(ctx, {
        "command": "python3 -c 'x = bytearray(512 * 1024 * 1024); print(\"ALLOCATED\")' 2>&1"})
    assert memory["output"] == "ALLOCATED\n"


async def test_members_share_ports_inside_and_the_host_cannot_reach_them(pool, alice, tmp_path):
    ctx, box = await _context(pool, alice, tmp_path)
    port = 18765
    await sandbox_tools.run_command(ctx, {
        "command": f"echo served > page.txt; python3 -m http.server {port} --bind 127.0.0.1",
        "background": True})
    fetch = (f"for i in $(seq 100); do python3 -c \"import urllib.request; print(urllib.request"
             f".urlopen('http://127.0.0.1:{port}/page.txt').read().decode())\" 2>/dev/null "
             "&& break; sleep 0.1; done")
    # A second call (as another member's would) joins the same namespace.
    assert (await sandbox_tools.run_command(ctx, {"command": fetch}))["output"] == "served\n\n"
    # The host's loopback is another network: nothing listens there.
    host = subprocess.run(["python3", "-c", f"import socket; socket.create_connection("
                           f"('127.0.0.1', {port}), 1)"], capture_output=True)
    assert host.returncode != 0


async def test_release_kills_the_namespace_and_keeps_the_workdir(pool, alice, tmp_path):
    ctx, box = await _context(pool, alice, tmp_path)
    await sandbox_tools.run_command(ctx, {"command": "echo kept > kept.txt; sleep 311.77",
                                          "background": True})
    # Started by a second worker process of the host, the agent would be
    # found through its socket: the holder's process group is recorded once.
    await sandbox_tools.run_command(ctx, {"command": "true"})
    (holder,) = await rows(pool, "SELECT pid, command FROM yuxi.sandbox_processes")
    assert holder["command"] == "(sandbox holder: bwrap)"
    assert _alive("sleep 311.77")
    tree = ctx.run["tree_id"]
    await runs.complete(pool, ctx.run_id, ctx.token, {"text": "done"})
    assert await sandbox.release_idle(pool, tmp_path, now=at(6)) == [tree]
    assert _gone("sleep 311.77")
    with pytest.raises(ProcessLookupError):
        os.kill(holder["pid"], 0)
    assert (box.workdir / "kept.txt").read_text() == "kept\n"


def _gone(pattern: str, seconds: float = 10.0) -> bool:
    """The kernel tears a killed pid namespace down asynchronously: its
    processes disappear shortly after the init's SIGKILL returns."""
    deadline = time.monotonic() + seconds
    while _alive(pattern):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0


CONNECT = ("python3 -c \"import socket, sys\nfor host in sys.argv[1:]:\n try:\n"
           "  socket.create_connection((host, 5432), 2); print(host, 'CONNECTED')\n"
           " except OSError as e: print(host, e)\" 127.0.0.1 10.0.2.2; cat /proc/net/dev")


async def test_outbound_network_keeps_the_host_loopback_out(pool, alice, tmp_path, monkeypatch):
    ctx, box = await _context(pool, alice, tmp_path, sandbox_network="outbound")
    out = (await sandbox_tools.run_command(ctx, {"command": CONNECT}))["output"]
    # The tree has an interface to the outside, and no way to the host's
    # PostgreSQL: not its own 127.0.0.1, not slirp's alias of the host.
    assert "tap0" in out and "CONNECTED" not in out, out
    # The negative: without --disable-host-loopback, 10.0.2.2 is the host.
    monkeypatch.setattr(confine, "SLIRP_ARGS", ["--configure", "--mtu=65520"])
    ctx2, box2 = await _context(pool, alice, tmp_path / "other", sandbox_network="outbound")
    out = (await sandbox_tools.run_command(ctx2, {"command": CONNECT}))["output"]
    assert "10.0.2.2 CONNECTED" in out, out
