"""The agent inside a tree's confined sandbox (standard library only).

The worker starts it once per sandbox generation inside bubblewrap (see
yuxi.runtime.confine) and hands it a listening unix socket as an inherited
file descriptor. Every later command and file operation of the tree is a
request on that socket: the agent runs it as its own child, so all of the
tree's processes share one set of namespaces (its network, its /proc, its
/tmp) and die together when the sandbox is released.

Protocol: one connection per request; one JSON line in, one JSON line out.
A client that closes the connection while a command runs kills the
command's process group (that is how the worker cancels or times out).

Everything here already runs confined: the checks below keep the tools'
semantics (paths relative to the workdir), not the host's safety.
"""

import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time

WORKDIR = "/workspace"
MAX_REQUEST = 4 * 1024 * 1024


def _limits(limits):
    """preexec_fn: the command's rlimits (inherited by everything it starts)."""
    pairs = [(resource.RLIMIT_CPU, limits.get("cpu_seconds")),
             (resource.RLIMIT_AS, limits.get("memory_bytes")),
             (resource.RLIMIT_NPROC, limits.get("processes")),
             (resource.RLIMIT_FSIZE, limits.get("file_bytes"))]

    def apply():
        for which, value in pairs:
            if value:
                resource.setrlimit(which, (int(value), int(value)))
    return apply


def _inside(raw):
    """The absolute path in the workdir that `raw` names, or an error."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError("invalid_arguments", "path must be a non-empty string")
    if raw.startswith("/") or ".." in raw.split("/"):
        raise ValueError("path_outside_workdir",
                         "%r: use a path relative to the workdir, without '..'" % raw)
    target = os.path.realpath(os.path.join(WORKDIR, raw))
    if target != WORKDIR and not target.startswith(WORKDIR + "/"):
        raise ValueError("path_outside_workdir", "%r leads outside the workdir" % raw)
    return target


def _read_file(req):
    path = _inside(req.get("path"))
    if not os.path.isfile(path):
        raise ValueError("not_found", "no file %r in the workdir" % req.get("path"))
    limit = int(req.get("max_bytes", 256 * 1024))
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return {"content": data[:limit].decode(errors="replace"), "truncated": len(data) > limit}


def _write_file(req):
    path = _inside(req.get("path"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(req.get("content", ""))
    return {}


def _list_files(req):
    path = _inside(req.get("path") or ".")
    if not os.path.isdir(path):
        raise ValueError("not_found", "no directory %r in the workdir" % req.get("path"))
    names = []
    for name in os.listdir(path):
        full = os.path.join(path, name)
        names.append(os.path.relpath(full, WORKDIR) + ("/" if os.path.isdir(full) else ""))
    return {"files": sorted(names)}


def _background(req):
    # Detached on purpose: the launcher shell exits at once, the command is
    # re-parented to the namespace's init (which reaps it) and lives until
    # the sandbox is released.
    launcher = subprocess.run(
        ["/bin/sh", "-c", 'setsid sh -c "$1" </dev/null >/dev/null 2>&1 & echo $!', "sh",
         req["command"]],
        cwd=WORKDIR, env=req.get("env") or {}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, preexec_fn=_limits(req.get("limits") or {}), check=False)
    return {"pid": int(launcher.stdout.decode().strip())}


def _command(req, conn):
    """Run a command to its end, its timeout or its client's hang-up."""
    max_output = int(req.get("max_output", 64 * 1024))
    proc = subprocess.Popen(
        ["/bin/sh", "-c", req["command"]], cwd=WORKDIR, env=req.get("env") or {},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=_limits(req.get("limits") or {}))
    kept = bytearray()

    def drain():
        # Everything is read, so the command never blocks on a full pipe.
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                return
            if len(kept) <= max_output:
                kept.extend(chunk)
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + float(req.get("timeout", 30))
    timed_out = hung_up = False
    while proc.poll() is None:
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(65536):
            hung_up = True  # the client sends nothing more: EOF is its hang-up
        elif time.monotonic() >= deadline:
            timed_out = True
        if timed_out or hung_up:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            break
    reader.join(timeout=5)
    return {"exit_code": proc.returncode, "output": bytes(kept[:max_output]).decode(errors="replace"),
            "truncated": len(kept) > max_output, "timed_out": timed_out}


OPS = {"read_file": _read_file, "write_file": _write_file, "list_files": _list_files,
       "background": _background, "ping": lambda req: {"ok": True}}


def serve(conn):
    with conn:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk or len(buf) > MAX_REQUEST:
                return
            buf += chunk
        try:
            req = json.loads(buf)
            if req.get("op") == "run":
                reply = _command(req, conn)
            else:
                reply = OPS[req.get("op")](req)
        except ValueError as exc:
            code, message = exc.args if len(exc.args) == 2 else ("invalid_request", str(exc))
            reply = {"error": {"code": code, "message": message}}
        except (KeyError, TypeError, OSError) as exc:
            reply = {"error": {"code": "sandbox_error", "message": "%s: %s" % (
                type(exc).__name__, exc)}}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


def main():
    listener = socket.socket(fileno=int(sys.argv[1]))
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
