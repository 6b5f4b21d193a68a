"""Where a tree's commands and file operations run: confined (bubblewrap,
the default) or, when an operator opts out with YUXI_SANDBOX=host, on the
worker's host as the worker itself (unsafe: see docs/sandbox.md).

Confined, a sandbox generation has one long-lived holder: `bwrap` with new
user, pid, network, mount, ipc and uts namespaces running the agent of
yuxi.runtime.sandbox_agent. The worker gives it a listening unix socket
(`<generation>/agent.sock`, outside everything the sandbox can see) and
sends each command or file operation over it, so every member of the tree
shares one network namespace and one /proc, and none of them reaches the
host's loopback (PostgreSQL, the API), its files, or the worker's
environment. The holder's process group is recorded like a background
process: the idle release kills it, and with it the whole pid namespace.

Any worker process of the host reaches a generation's agent through its
socket; the one that finds none answering starts a new holder, under a
file lock so two workers never start two.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any

from yuxi.runtime.tools import ToolError
from yuxi.settings import Settings

AGENT_SOURCE = (Path(__file__).parent / "sandbox_agent.py").read_text()
# Inside the sandbox: the workdir, the temp area, the sandbox user.
WORKDIR = "/workspace"
TMPDIR = "/tmp"
UID = 1000
# The system's directories, read-only, so installed interpreters and tools
# work; of /etc only what programs need to run (never shadow, ssl keys, the
# host's database or pip configuration).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_ENTRIES = ("alternatives", "ca-certificates", "ssl/certs", "localtime", "timezone",
               "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "mime.types",
               "protocols", "services", "bash.bashrc", "inputrc", "profile", "debian_version",
               "os-release", "magic", "magic.mime", "python3", "python3.11", "python3.12",
               "python3.13", "gai.conf", "host.conf", "locale.alias")
# slirp4netns: NAT to the internet, never to the host's own loopback.
SLIRP_ARGS = ["--configure", "--mtu=65520", "--disable-host-loopback"]
# bwrap's own environment: its init inside the sandbox keeps it (readable
# in /proc/1/environ there), so it never gets the worker's.
LAUNCH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
# A reply may escape every byte of 256 KiB of output (JSON's \uXXXX).
MAX_REPLY = 8 * 1024 * 1024

Record = Callable[[int, str], Awaitable[None]]
StopCheck = Callable[[], Awaitable[bool]]


def unavailable(message: str) -> ToolError:
    return ToolError("sandbox_unavailable", message)


@contextlib.contextmanager
def _short(path: Path):
    """`path` usable as a unix socket address: sun_path holds 107 bytes, a
    data dir deep in a tree does not, so a long one goes through the
    directory's descriptor (/proc/self/fd/N/name)."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


class Bubblewrap:
    """Confined sandboxes: one bwrap holder and agent per generation."""

    confined = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bwrap = shutil.which(settings.sandbox_bwrap)
        self.python = settings.sandbox_python

    def unavailable_reason(self) -> str | None:
        if self.bwrap is None:
            return (f"bubblewrap ({self.settings.sandbox_bwrap!r}) is not installed on this "
                    "worker host: install the 'bubblewrap' package (make setup does), or set "
                    "YUXI_SANDBOX=host to run commands unconfined (unsafe)")
        if not os.access(self.python, os.X_OK):
            return f"{self.python} (the sandbox agent's interpreter) is missing on this host"
        if self.settings.sandbox_network == "outbound" and shutil.which("slirp4netns") is None:
            return "YUXI_SANDBOX_NETWORK=outbound needs slirp4netns, which is not installed"
        return None

    def env(self, box: Any) -> dict[str, str]:
        """The allow-list: nothing of the worker's environment but its locale."""
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": TMPDIR,
                "TERM": self.settings.sandbox_term, "USER": "sandbox",
                **self.settings.sandbox_locale}

    def limits(self) -> dict[str, int]:
        s = self.settings
        return {"cpu_seconds": s.sandbox_cpu_seconds,
                "memory_bytes": s.sandbox_memory_mb * 1024 * 1024,
                "processes": s.sandbox_processes,
                "file_bytes": s.sandbox_file_mb * 1024 * 1024}

    # -- the holder -----------------------------------------------------------

    def _etc_files(self) -> dict[str, bytes]:
        """The sandbox's own user, hosts and resolver (slirp4netns' DNS)."""
        return {
            "passwd": (f"root:x:0:0::/:/usr/sbin/nologin\n"
                       f"sandbox:x:{UID}:{UID}::{WORKDIR}:/bin/sh\n"
                       "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n").encode(),
            "group": f"root:x:0:\nsandbox:x:{UID}:\nnogroup:x:65534:\n".encode(),
            "hosts": b"127.0.0.1 localhost sandbox\n::1 localhost\n",
            "resolv.conf": b"nameserver 10.0.2.3\n",
        }

    def _arguments(self, fds: dict[str, int], box: Any, info_fd: int, sock_fd: int
                   ) -> list[str]:
        """bwrap's command line.

        A root worker runs bwrap privileged (new pid, network, mount, ipc and
        uts namespaces) and the agent as an unprivileged host user (setpriv:
        no capabilities, no new privileges) in a user namespace of its own:
        root-owned host files stay out of reach even where mounted, and the
        kernel enforces the process limit (it exempts root's processes). A
        worker that is not root runs bwrap unprivileged, with a user
        namespace of its own from the start."""
        if os.geteuid() == 0:
            uid = str(self.settings.sandbox_uid)
            args = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net",
                    "--unshare-uts", "--unshare-cgroup-try"]
            agent = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                     "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--",
                     "unshare", "--user", f"--map-user={UID}", f"--map-group={UID}", "--"]
        else:
            args = [self.bwrap, "--unshare-all", "--unshare-user", "--uid", str(UID),
                    "--gid", str(UID), "--cap-drop", "ALL"]
            agent = []
        args += ["--new-session", "--hostname", "sandbox", "--proc", "/proc", "--dev", "/dev",
                 "--bind", str(box.workdir), WORKDIR, "--bind", str(box.tmp), TMPDIR,
                 "--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                 "--info-fd", str(info_fd)]
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        for name in ETC_ENTRIES:
            if os.path.exists(f"/etc/{name}"):
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        for name in self._etc_files():
            args += ["--ro-bind-data", str(fds[name]), f"/etc/{name}"]
        return [*args, "--", *agent, self.python, "-I", "-S", "-c", AGENT_SOURCE, str(sock_fd)]

    def _start_holder(self, box: Any) -> list[tuple[int, str]]:
        """Start the generation's holder unless one answers; returns the
        process groups to record (killed at release). Blocking: call it in
        a thread."""
        home = Path(box.tmp).parent
        with open(home / "holder.lock", "w") as lock, contextlib.ExitStack() as fds:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _answers(home / "agent.sock"):
                return []
            (home / "agent.sock").unlink(missing_ok=True)
            if os.geteuid() == 0:
                for d in (box.workdir, box.tmp):
                    os.chown(d, self.settings.sandbox_uid, self.settings.sandbox_uid)
            opened: dict[str, int] = {}
            for name, content in self._etc_files().items():
                r, w = os.pipe()  # a few bytes: the pipe holds them
                os.write(w, content)
                os.close(w)
                opened[name] = r
                fds.callback(os.close, r)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            fds.callback(listener.close)
            with _short(home / "agent.sock") as address:
                listener.bind(address)
            listener.listen(64)
            info_r, info_w = os.pipe()
            if self.settings.sandbox_network == "outbound":
                # The agent holds the write end for the sandbox's lifetime:
                # slirp4netns exits when it closes (see _start_network).
                exit_fd, lifeline = os.pipe()
                fds.callback(os.close, exit_fd)
            else:
                lifeline = None
            try:
                # Detached (a session of its own, re-parented to init): the
                # holder outlives this worker (the release kills the
                # namespace's init, see below).
                subprocess.run(
                    ["/bin/sh", "-c", 'log=$1; shift; setsid "$@" </dev/null >>"$log" 2>&1 &',
                     "sh", str(home / "holder.log"),
                     *self._arguments(opened, box, info_w, listener.fileno())],
                    pass_fds=(info_w, listener.fileno(), *opened.values(),
                              *([lifeline] if lifeline is not None else [])),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True,
                    env=LAUNCH_ENV)
            finally:
                os.close(info_w)
                if lifeline is not None:
                    os.close(lifeline)
            with os.fdopen(info_r, "rb") as info:
                raw = info.read()  # until bwrap closes it: the sandbox is set up
            if not raw:
                why = _holder_log(home)
                raise unavailable(f"bubblewrap could not create the sandbox: {why or 'no reason given'}")
            # The namespace's init leads a process group of its own: killing
            # it ends every process of the pid namespace (bwrap's outer
            # process then exits by itself).
            child = json.loads(raw)["child-pid"]
            started = [(child, "(sandbox holder: bwrap)")]
            if self.settings.sandbox_network == "outbound":
                started.append((self._start_network(child, exit_fd),
                                "(sandbox network: slirp4netns)"))
            return started

    def _start_network(self, child: int, exit_fd: int) -> int:
        """Outbound internet for the holder's network namespace (user-mode
        NAT), without the host's loopback; returns its process group once
        the interface is up. It exits when the holder's end of its exit pipe
        closes, however the holder ends."""
        ready_r, ready_w = os.pipe()
        try:
            net = subprocess.run(
                ["/bin/sh", "-c", 'setsid "$@" </dev/null >/dev/null 2>&1 & echo $!', "sh",
                 "slirp4netns", *SLIRP_ARGS, f"--ready-fd={ready_w}", f"--exit-fd={exit_fd}",
                 str(child), "tap0"],
                pass_fds=(ready_w, exit_fd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                check=True, env=LAUNCH_ENV)
        finally:
            os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            if ready.read(1) != b"1":
                raise unavailable("slirp4netns could not set up the sandbox's network")
        return int(net.stdout.decode().strip())

    # -- requests -------------------------------------------------------------

    async def _connect(self, box: Any, record: Record):
        """A connection to the generation's agent, starting it if needed."""
        if (why := self.unavailable_reason()) is not None:
            raise unavailable(why)
        path = Path(box.tmp).parent / "agent.sock"
        for attempt in range(2):
            try:
                with _short(path) as address:
                    return await asyncio.open_unix_connection(address, limit=MAX_REPLY)
            except (FileNotFoundError, ConnectionRefusedError):
                if attempt:
                    why = _holder_log(path.parent)
                    raise unavailable("the sandbox agent does not answer"
                                      + (f": {why}" if why else "")) from None
            for pid, what in await asyncio.to_thread(self._start_holder, box):
                await record(pid, what)
        raise AssertionError("unreachable")

    async def call(self, box: Any, request: dict[str, Any], record: Record,
                   stop: StopCheck | None = None, deadline: float | None = None
                   ) -> dict[str, Any] | None:
        """Send one request; None when `stop` said so or `deadline` passed
        first (closing the connection makes the agent kill the command)."""
        reader, writer = await self._connect(box, record)
        loop = asyncio.get_running_loop()
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            reply = asyncio.ensure_future(reader.readline())
            while True:
                try:
                    line = await asyncio.wait_for(asyncio.shield(reply), timeout=0.5)
                    break
                except TimeoutError:
                    if (deadline is not None and loop.time() >= deadline) or (
                            stop is not None and await stop()):
                        reply.cancel()
                        return None
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as exc:
            raise ToolError("sandbox_error", f"the sandbox agent failed: {exc}") from None
        finally:
            writer.close()
        if not line:
            raise ToolError("sandbox_error", "the sandbox agent closed the connection")
        answer = json.loads(line)
        if "error" in answer:
            raise ToolError(answer["error"]["code"], answer["error"]["message"])
        return answer


def _holder_log(home: Path) -> str:
    """The end of what a generation's holder (bwrap, the agent) logged."""
    log = home / "holder.log"
    return log.read_text(errors="replace").strip()[-500:] if log.exists() else ""


def _answers(path: Path) -> bool:
    """Whether an agent listens on `path` (it accepts; a dead holder's
    socket refuses)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short(path) as address:
            s.connect(address)
        s.sendall(b'{"op": "ping"}\n')
        s.settimeout(5)
        return s.recv(64).startswith(b'{"ok"')
    except OSError:
        return False
    finally:
        s.close()


class Host:
    """YUXI_SANDBOX=host: commands run on the worker's host, as the worker,
    with its environment (the behaviour before confinement; unsafe)."""

    confined = False

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def unavailable_reason(self) -> str | None:
        return None

    def env(self, box: Any) -> dict[str, str]:
        # The opt-out is explicit: the operator accepted that a model's
        # commands see everything the worker sees.
        return {**os.environ, "TMPDIR": str(box.tmp), "HOME": str(box.workdir)}


def host_path(box: Any, raw: Any) -> Path:
    """The path inside the workdir that `raw` names on the host; absolute
    paths, `..` and symlinks leading out are refused (host mode only:
    confined, the agent resolves paths inside the sandbox)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ToolError("invalid_arguments", "path must be a non-empty string")
    relative = PurePosixPath(raw)
    if relative.is_absolute() or ".." in relative.parts:
        raise ToolError("path_outside_workdir",
                        f"{raw!r}: use a path relative to the workdir, without '..'")
    root = box.workdir.resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise ToolError("path_outside_workdir", f"{raw!r} leads outside the workdir")
    return target


def for_settings(settings: Settings) -> Bubblewrap | Host:
    return Host(settings) if settings.sandbox == "host" else Bubblewrap(settings)

