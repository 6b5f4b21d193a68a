"""Tools over the tree's shared workdir and sandbox: read_file, write_file,
list_files (paths confined to the workdir) and run_command (a shell command
in the sandbox: the workdir as cwd, the sandbox temp area as $TMPDIR).

They belong to the tool group `sandbox` (a grant the run must see when it
starts); write_file and run_command are side effects: they ask first in
approval mode "confirm" and re-check the grant when they execute.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path, PurePosixPath
from typing import Any

from yuxi import db
from yuxi.runtime.tools import Tool, ToolContext, ToolError, register
from yuxi.services import runs

MAX_OUTPUT = 64 * 1024
MAX_READ = 256 * 1024
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 600.0


def confined(ctx: ToolContext, raw: Any) -> Path:
    """The path inside the workdir that `raw` names; absolute paths, `..`
    and symlinks leading out are refused."""
    if ctx.sandbox is None:
        raise ToolError("no_sandbox", "this run has no sandbox")
    if not isinstance(raw, str) or not raw.strip():
        raise ToolError("invalid_arguments", "path must be a non-empty string")
    relative = PurePosixPath(raw)
    if relative.is_absolute() or ".." in relative.parts:
        raise ToolError("path_outside_workdir",
                        f"{raw!r}: use a path relative to the workdir, without '..'")
    root = ctx.sandbox.workdir.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise ToolError("path_outside_workdir", f"{raw!r} leads outside the workdir")
    return target


async def _effect_checks(ctx: ToolContext) -> None:
    """A side effect checks the run's lease and the user's grant now."""
    async with ctx.pool.connection() as conn:
        await db.execute(conn, "check_lease", {"run_id": ctx.run_id, "token": ctx.token})
        with db.domain_errors():
            await db.fetch_one(conn, "check_grant", {
                "user_id": ctx.run["user_id"], "app_id": ctx.run["app_id"],
                "kind": "tool_group", "name": "sandbox"})


async def read_file(ctx: ToolContext, args: dict[str, Any]) -> Any:
    path = confined(ctx, args.get("path"))
    if not path.is_file():
        raise ToolError("not_found", f"no file {args.get('path')!r} in the workdir")
    data = path.read_bytes()[:MAX_READ]
    return {"path": args["path"], "content": data.decode(errors="replace"),
            "truncated": path.stat().st_size > MAX_READ}


async def write_file(ctx: ToolContext, args: dict[str, Any]) -> Any:
    path = confined(ctx, args.get("path"))
    content = args.get("content", "")
    if not isinstance(content, str):
        raise ToolError("invalid_arguments", "content must be a string")
    await _effect_checks(ctx)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return {"path": args["path"], "bytes": len(content.encode())}


async def list_files(ctx: ToolContext, args: dict[str, Any]) -> Any:
    path = confined(ctx, args.get("path") or ".")
    if not path.is_dir():
        raise ToolError("not_found", f"no directory {args.get('path')!r} in the workdir")
    root = ctx.sandbox.workdir.resolve()
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
    if ctx.sandbox is None:
        raise ToolError("no_sandbox", "this run has no sandbox")
    await _effect_checks(ctx)
    box = ctx.sandbox
    env = {**os.environ, "TMPDIR": str(box.tmp), "HOME": str(box.workdir)}
    if args.get("background"):
        # Detached on purpose: it outlives this call (and this worker) in its
        # own session, re-parented to init; asyncio would kill a child it
        # still tracks. The sandbox release kills its process group.
        launcher = await asyncio.create_subprocess_exec(
            "sh", "-c", 'setsid sh -c "$1" </dev/null >/dev/null 2>&1 & echo $!', "sh", command,
            cwd=box.workdir, env=env, stdout=asyncio.subprocess.PIPE)
        pid = int((await launcher.communicate())[0].decode().strip())
        async with ctx.pool.connection() as conn:
            await db.execute(conn, "record_sandbox_process", {
                "generation": box.generation, "pid": pid, "run_id": ctx.run_id,
                "token": ctx.token, "command": command})
        return {"pid": pid, "background": True}
    proc = await asyncio.create_subprocess_shell(
        command, cwd=box.workdir, env=env, start_new_session=True,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    reader = asyncio.create_task(_read_bounded(proc.stdout))
    ended = timed_out = cancelled = False
    deadline = asyncio.get_running_loop().time() + min(float(timeout), MAX_TIMEOUT)
    try:
        while not ended:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=0.5)
                ended = True
            except TimeoutError:
                if asyncio.get_running_loop().time() >= deadline:
                    timed_out = True
                elif await runs.cancel_requested(ctx.pool, ctx.run["turn_id"]):
                    cancelled = True  # stop only this turn's own command
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


register("read_file", Tool(read_file, group="sandbox"))
register("write_file", Tool(write_file, group="sandbox", side_effect=True))
register("list_files", Tool(list_files, group="sandbox"))
register("run_command", Tool(run_command, group="sandbox", side_effect=True))
