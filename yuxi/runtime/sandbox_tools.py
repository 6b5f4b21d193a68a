"""Tools over the tree's shared workdir and sandbox: read_file, write_file,
list_files (paths confined to the workdir) and run_command (a shell command
in the sandbox: the workdir as cwd and $HOME, the sandbox temp area as
$TMPDIR). Where they run is yuxi.runtime.confine's: inside the tree's
bubblewrap sandbox, or on the host when the operator opted out.

They belong to the tool group `sandbox` (a grant the run must see when it
starts); write_file and run_command are side effects: they ask first in
approval mode "confirm" and re-check the grant when they execute.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from yuxi import db
from yuxi.runtime import confine
from yuxi.runtime.tools import Tool, ToolContext, ToolError, register
from yuxi.services import runs, sandbox

MAX_OUTPUT = 64 * 1024
MAX_READ = 256 * 1024
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 600.0


def _box(ctx: ToolContext) -> Any:
    if ctx.sandbox is None:
        raise ToolError("no_sandbox", "this run has no sandbox")
    return ctx.sandbox


def _path_arg(raw: Any) -> str:
    """A path argument as the model gave it; where it leads is checked
    where it is used (on the host, or by the agent inside the sandbox)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ToolError("invalid_arguments", "path must be a non-empty string")
    return raw


async def _effect_checks(ctx: ToolContext) -> None:
    """A side effect checks the run's lease and the user's grant now."""
    async with ctx.pool.connection() as conn:
        await db.execute(conn, "check_lease", {"run_id": ctx.run_id, "token": ctx.token})
        with db.domain_errors():
            await db.fetch_one(conn, "check_grant", {
                "user_id": ctx.run["user_id"], "app_id": ctx.run["app_id"],
                "kind": "tool_group", "name": "sandbox"})


def _recorder(ctx: ToolContext, box: Any):
    """Records a process group of the sandbox (killed at its release),
    fenced by the run's lease."""
    async def record(pid: int, command: str) -> None:
        # '' when the leader has exited already: its group may live on.
        identity = sandbox.process_identity(pid) or ""
        async with ctx.pool.connection() as conn:
            await db.execute(conn, "record_sandbox_process", {
                "generation": box.generation, "pid": pid, "identity": identity,
                "run_id": ctx.run_id,
                "token": ctx.token, "command": command})
    return record


async def _agent(ctx: ToolContext, box: Any, request: dict[str, Any], **kw: Any) -> Any:
    return await box.jail.call(box, request, _recorder(ctx, box), **kw)


async def read_file(ctx: ToolContext, args: dict[str, Any]) -> Any:
    box, raw = _box(ctx), _path_arg(args.get("path"))
    if box.jail.confined:
        reply = await _agent(ctx, box, {"op": "read_file", "path": raw, "max_bytes": MAX_READ})
        return {"path": raw, **reply}
    path = confine.host_path(box, raw)
    if not path.is_file():
        raise ToolError("not_found", f"no file {raw!r} in the workdir")
    data = path.read_bytes()[:MAX_READ]
    return {"path": raw, "content": data.decode(errors="replace"),
            "truncated": path.stat().st_size > MAX_READ}


async def write_file(ctx: ToolContext, args: dict[str, Any]) -> Any:
    box, raw = _box(ctx), _path_arg(args.get("path"))
    content = args.get("content", "")
    if not isinstance(content, str):
        raise ToolError("invalid_arguments", "content must be a string")
    path = None if box.jail.confined else confine.host_path(box, raw)
    await _effect_checks(ctx)
    if path is None:
        await _agent(ctx, box, {"op": "write_file", "path": raw, "content": content})
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return {"path": raw, "bytes": len(content.encode())}


async def list_files(ctx: ToolContext, args: dict[str, Any]) -> Any:
    box = _box(ctx)
    raw = args.get("path") or "."
    if box.jail.confined:
        return await _agent(ctx, box, {"op": "list_files", "path": _path_arg(raw)})
    path = confine.host_path(box, raw)
    if not path.is_dir():
        raise ToolError("not_found", f"no directory {args.get('path')!r} in the workdir")
    root = box.workdir.resolve()
    return {"files": sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "")
                            for p in path.iterdir())}


async def _read_bounded(stream: asyncio.StreamReader) -> bytes:
    """Everything the command prints, up to MAX_OUTPUT + 1 bytes (the rest is
    drained so the command never blocks on a full pipe)."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) <= MAX_OUTPUT:
            kept += chunk
    return bytes(kept[:MAX_OUTPUT + 1])


async def run_command(ctx: ToolContext, args: dict[str, Any]) -> Any:
    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ToolError("invalid_arguments", "command must be a non-empty string")
    timeout = args.get("timeout_s", DEFAULT_TIMEOUT)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ToolError("invalid_arguments", "timeout_s must be a positive number")
    box = _box(ctx)
    if (why := box.jail.unavailable_reason()) is not None:
        raise confine.unavailable(why)
    await _effect_checks(ctx)
    timeout = min(float(timeout), MAX_TIMEOUT)
    cancelled = False

    async def stop() -> bool:
        nonlocal cancelled
        cancelled = await runs.cancel_requested(ctx.pool, ctx.run["turn_id"])
        return cancelled  # stop only this turn's own command

    if box.jail.confined:
        request = {"command": command, "env": box.jail.env(box), "limits": box.jail.limits()}
        if args.get("background"):
            reply = await _agent(ctx, box, {"op": "background", **request})
            return {"pid": reply["pid"], "background": True}
        # The agent times the command out; the worker's own deadline only
        # covers an agent that stopped answering.
        deadline = asyncio.get_running_loop().time() + timeout + 10
        reply = await _agent(ctx, box, {"op": "run", "timeout": timeout,
                                        "max_output": MAX_OUTPUT, **request},
                             stop=stop, deadline=deadline)
        if reply is None:
            return {"exit_code": None, "output": "", "truncated": False,
                    "timed_out": not cancelled, "cancelled": cancelled}
        return {**reply, "cancelled": False}
    return await _run_on_host(ctx, box, command, timeout, bool(args.get("background")), stop)


async def _run_on_host(ctx: ToolContext, box: Any, command: str, timeout: float,
                       background: bool, stop: Any) -> Any:
    """YUXI_SANDBOX=host: the command runs as the worker (unsafe)."""
    env = box.jail.env(box)
    if background:
        # Detached on purpose: it outlives this call (and this worker) in its
        # own session, re-parented to init; asyncio would kill a child it
        # still tracks. The sandbox release kills its process group.
        launcher = await asyncio.create_subprocess_exec(
            "sh", "-c", 'setsid sh -c "$1" </dev/null >/dev/null 2>&1 & echo $!', "sh", command,
            cwd=box.workdir, env=env, stdout=asyncio.subprocess.PIPE)
        pid = int((await launcher.communicate())[0].decode().strip())
        await _recorder(ctx, box)(pid, command)
        return {"pid": pid, "background": True}
    proc = await asyncio.create_subprocess_shell(
        command, cwd=box.workdir, env=env, start_new_session=True,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    reader = asyncio.create_task(_read_bounded(proc.stdout))
    ended = timed_out = cancelled = False
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while not ended:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=0.5)
                ended = True
            except TimeoutError:
                if asyncio.get_running_loop().time() >= deadline:
                    timed_out = True
                elif await stop():
                    cancelled = True
                if timed_out or cancelled:
                    break
    finally:
        if not ended:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    output = await reader
    return {"exit_code": proc.returncode, "output": output[:MAX_OUTPUT].decode(errors="replace"),
            "truncated": len(output) > MAX_OUTPUT, "timed_out": timed_out,
            "cancelled": cancelled}


_PATH = {"type": "string", "description": "a path relative to the tree's workdir"}
register("read_file", Tool(read_file, group="sandbox",
                           description="Read a file of the workdir.",
                           schema={"properties": {"path": _PATH}, "required": ["path"]}))
register("write_file", Tool(write_file, group="sandbox", side_effect=True,
                            description="Write (create or replace) a file of the workdir.",
                            schema={"properties": {"path": _PATH, "content": {"type": "string"}},
                                    "required": ["path", "content"]}))
register("list_files", Tool(list_files, group="sandbox",
                            description="List a directory of the workdir.",
                            schema={"properties": {"path": _PATH}}))
register("run_command", Tool(run_command, group="sandbox", side_effect=True,
                             description="Run a shell command in the tree's sandbox "
                                         "(cwd: the workdir).",
                             schema={"properties": {
                                 "command": {"type": "string"},
                                 "timeout_s": {"type": "number", "exclusiveMinimum": 0},
                                 "background": {"type": "boolean"}},
                                 "required": ["command"]}))
