"""What a worker sends and hears outside the events table:

- `DeltaBatcher`: text deltas of a streaming model call, NOTIFYed on
  `yuxi_deltas` about every 50 ms in payloads under 8 KB. They touch no
  table, are not numbered and are never replayed (`message.delta` on SSE).
- `WorkerListener`: the worker process's one LISTEN connection, on
  `yuxi_cancel` (the turns trigger of sql/130_models.sql): a model call of a
  turn whose cancel commits is aborted at once, with its HTTP request; on
  `yuxi_ready` (sql/020_slots.sql): the ready runs the worker claims; and on
  Procrastinate's job channels, for its worker (`relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from yuxi import db

log = logging.getLogger(__name__)

DELTA_CHANNEL = "yuxi_deltas"
CANCEL_CHANNEL = "yuxi_cancel"
# Ready runs, for an idle worker to claim (sql/020_slots.sql, defer_run_job_v1).
READY_CHANNEL = "yuxi_ready"
# The application_name of a claiming worker's LISTEN connection, + its host
# (how yuxi.claimers_v1 finds the claimers).
CLAIMER = "yuxi-claims "
FLUSH_SECONDS = 0.05
# Characters of text per payload: even 6 bytes per character (JSON escapes)
# keeps a payload under PostgreSQL's 8000-byte limit.
MAX_CHARS = 1000


def delta_payloads(ids: dict[str, str], message_id: str, text: str) -> list[str]:
    """The NOTIFY payloads of `text` (split so that each is < 8000 bytes)."""
    out = []
    for i in range(0, len(text), MAX_CHARS):
        out.append(msgspec.json.encode({**ids, "message_id": message_id,
                                        "delta": text[i:i + MAX_CHARS]}).decode())
    return out


class DeltaBatcher:
    """Collects one run's deltas and NOTIFYs them in batches."""

    def __init__(self, pool: AsyncConnectionPool, run: dict[str, Any]) -> None:
        self.pool = pool
        self.ids = {"tree_id": str(run["tree_id"]), "session_id": str(run["session_id"]),
                    "turn_id": str(run["turn_id"]), "run_id": str(run["id"])}
        self._message_id: str | None = None
        self._parts: list[str] = []
        self._timer: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def add(self, message_id: str, text: str) -> None:
        if self._message_id not in (None, message_id):
            await self.flush()
        self._message_id = message_id
        self._parts.append(text)
        if self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(FLUSH_SECONDS)
        await self._send()

    async def flush(self) -> None:
        """Send what is pending now (before the durable message commits)."""
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        await self._send()

    async def _send(self) -> None:
        async with self._lock:
            if not self._parts or self._message_id is None:
                return
            text, self._parts = "".join(self._parts), []
            try:
                async with self.pool.connection() as conn:
                    for payload in delta_payloads(self.ids, self._message_id, text):
                        await db.execute(conn, "notify_delta",
                                         {"payload": payload, "tree_id": self.ids["tree_id"]})
            except Exception as exc:  # deltas are best effort, never a failure
                log.warning("deltas of run %s not sent: %s", self.ids["run_id"], exc)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._timer


class CallCancelled(Exception):
    """The turn's cancel notification arrived: its model call was aborted."""


class _Watched:
    def __init__(self) -> None:
        self.cancelled = False
        self.calls: set[asyncio.Task] = set()
        self.cancelled_at: float | None = None


class WorkerListener:
    """One LISTEN connection per worker process, on `yuxi_cancel`, and on
    `yuxi_ready` when `on_ready` is set (the worker's claims) before it
    starts (`start`, else the first watched turn starts it)."""

    def __init__(self, url: str, *, poll_seconds: float = 5.0) -> None:
        self.url = url
        self.poll_seconds = poll_seconds
        self._turns: dict[str, list[_Watched]] = {}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self.on_ready: Callable[[str], None] | None = None
        # A claiming worker's host (set with on_ready): its LISTEN connection
        # is named for it, so that the server knows the claimers
        # (yuxi.claimers_v1) and announces each ready run to one of them.
        self.claimer_host: str | None = None
        self.pid: int | None = None  # this listener's backend
        # Channels heard for someone else (Procrastinate's worker, `relay`),
        # each with its callback; and the channels the current connection
        # listens to (None until it has chosen them).
        self._relays: dict[str, Callable[..., Awaitable[None]]] = {}
        self._listening: frozenset[str] | None = None
        self._relayed: set[asyncio.Task] = set()

    def stop_claiming(self) -> asyncio.Task | None:
        """Hear no more ready runs, and leave the claimers' set at once (a
        claimer that stays listed would be picked for runs it no longer
        claims). The connection is made again, without the claims, while a
        turn is watched or a relay runs; else the next watched turn makes it.
        Returns the cancelled listening task (awaited, its connection is
        closed), or None."""
        self.on_ready, self.claimer_host = None, None
        if self._task is None or self._task.done():
            return None
        return self._listen_again()

    def _listen_again(self) -> asyncio.Task:
        """Cancel the running listening task (returned) and make the
        connection again, with what is to be heard now (claims, a watched
        turn's cancel, relays), if anything is."""
        stopped = self._task
        assert stopped is not None
        stopped.cancel()
        self._ready.clear()
        self._task = None
        if self.on_ready is not None or self._turns or self._relays:
            self._start_task()
        return stopped

    @property
    def claimer(self) -> int | None:
        """This worker's name among the claimers (runs.claimer): the backend
        of its LISTEN connection while it claims; None when it does not."""
        return self.pid if self.on_ready is not None else None

    def picked(self, claimer: int) -> bool:
        """Whether a ready run announced to `claimer` (pick_claimer_v1, the
        least-loaded claimer of its queue) is this worker's to claim.
        Another worker's claim would only lose the race for the lease (a
        round trip and a wake-up on the same cores at the turn's start); a
        run its claimer leaves (no free slot, just gone) is fetched from the
        queue as its job. 0: no claimer listened when the run was announced
        (this one has just connected): every claimer claims it."""
        return claimer == 0 or claimer == self.pid

    async def _opened(self, conn: Any) -> None:
        """A claims connection made again ends the one before it, if the
        server still holds it (sql/queries.sql, end_former_claimer, which
        spares this connection and any backend under another name)."""
        if self.pid is None:
            return
        try:
            await db.execute(conn, "end_former_claimer", {"pid": self.pid})
        except Exception as exc:  # not allowed, say: the server's keepalives end it
            log.warning("the former claims connection (pid %s) stays: %s", self.pid, exc)

    def _connected(self, conn: Any) -> None:
        self.pid = conn.info.backend_pid
        self._ready.set()

    def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._start_task()

    def _start_task(self) -> None:
        self._listening = None
        self._task = asyncio.create_task(self._listen_forever(), name="yuxi-worker-listener")

    async def relay(self, channels: Iterable[str],
                    on_notification: Callable[..., Awaitable[None]]) -> None:
        """Hear `channels` too, passing each of their notifications to
        `on_notification(channel=, payload=)`, until cancelled: Procrastinate's
        worker hears its jobs here (workers.app.WorkerConnector), not on a
        LISTEN connection of its own. PostgreSQL wakes every listening
        backend of the database at each commit that notifies, whatever the
        channel: one connection less spares the server a wake-up at each
        such commit (benchmarks/README.md, stops 41-42). A connection that
        listens without them yet is made again with them."""
        wanted = frozenset(channels)
        for channel in wanted:
            self._relays[channel] = on_notification
        try:
            if (self._task is not None and not self._task.done()
                    and self._listening is not None and not wanted <= self._listening):
                self._listen_again()
            else:
                self._ensure_started()
            await asyncio.Future()  # until cancelled
        finally:
            for channel in wanted:
                if self._relays.get(channel) is on_notification:
                    del self._relays[channel]

    async def ready(self, timeout: float = 5.0) -> bool:
        self._ensure_started()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self._ready.is_set()

    @contextlib.contextmanager
    def watch(self, turn_id: uuid.UUID | str):
        self._ensure_started()
        key = str(turn_id)
        entry = _Watched()
        self._turns.setdefault(key, []).append(entry)
        try:
            yield entry
        finally:
            entries = self._turns.get(key, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                self._turns.pop(key, None)

    async def run(self, entry: _Watched, call: Awaitable[Any]) -> Any:
        """Await a model call; raise CallCancelled when the turn's cancel
        notification arrives first (the call's task is cancelled, which
        closes its HTTP request)."""
        if entry.cancelled:
            if asyncio.iscoroutine(call):
                call.close()
            raise CallCancelled()
        task = asyncio.ensure_future(call)
        entry.calls.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if entry.cancelled and not _current_cancelling():
                raise CallCancelled() from None
            raise
        finally:
            entry.calls.discard(task)
            if not task.done():
                task.cancel()

    def _cancel(self, turn_id: str) -> None:
        for entry in self._turns.get(turn_id, ()):
            entry.cancelled = True
            entry.cancelled_at = time.monotonic()
            for task in list(entry.calls):
                task.cancel()

    def _note(self, note: Any) -> None:
        if note.channel == CANCEL_CHANNEL:
            self._cancel(note.payload)
        elif note.channel == READY_CHANNEL:
            if self.on_ready is not None:
                self.on_ready(note.payload)
        elif (relay := self._relays.get(note.channel)) is not None:
            task = asyncio.create_task(self._relayed_note(relay, note.channel, note.payload))
            self._relayed.add(task)
            task.add_done_callback(self._relayed.discard)

    @staticmethod
    async def _relayed_note(relay: Callable[..., Awaitable[None]], channel: str,
                            payload: str) -> None:
        try:
            await relay(channel=channel, payload=payload)
        except Exception:
            log.exception("a notification on %s: %.200r", channel, payload)

    async def _listen_forever(self) -> None:
        # Missed notifications cost latency only: boundaries still check, and
        # a ready run's job is still in the queue.
        if self.on_ready is None:
            channels, url, on_open = (CANCEL_CHANNEL,), self.url, None
        else:
            channels, on_open = (CANCEL_CHANNEL, READY_CHANNEL), self._opened
            url = make_conninfo(self.url, application_name=f"{CLAIMER}{self.claimer_host}"[:63])

        def chosen() -> tuple[str, ...]:
            # At each connect: the relays registered by then come along.
            every = (*channels, *sorted(self._relays))
            self._listening = frozenset(every)
            return every

        await db.listen_forever(url, chosen, self._note,
                                what="worker listener", on_open=on_open,
                                on_connect=self._connected,
                                on_disconnect=self._ready.clear, poll_seconds=self.poll_seconds)


def _current_cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task and task.cancelling())
