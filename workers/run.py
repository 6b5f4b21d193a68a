"""One worker process: `python -m workers.run [--concurrency N]` (what
`yuxi worker` supervises and `yuxi dev` starts).

Procrastinate's worker stops (and `procrastinate worker` exits with status 0)
when its heartbeat meets a database error. (Its job notifications come through
this process's WorkerListener, which reconnects by itself:
workers.app.WorkerConnector.) Here the
database going away is no reason to exit: the worker is started again in the
same process once the database answers, with backoff, and says so. In-flight
runs are not lost meanwhile: a run cut off by the outage is reported as an
infrastructure fault and continued by recovery (docs/state-machines.md).

Exit status: 0 after SIGTERM/SIGINT (a graceful stop); 1 on any fatal error
(a bad setting, a schema of another version, a bug), never 0 by surprise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from yuxi.errors import is_connection_error

log = logging.getLogger("yuxi.worker")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 10.0


async def _database_answers(app) -> bool:
    try:
        return await app.job_manager.check_connection_async()
    except Exception as exc:
        if is_connection_error(exc):
            return False
        raise


async def serve(concurrency: int | None) -> int:
    from workers.app import app, settings
    from workers import tasks  # (the tasks, before the first job)

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    current: asyncio.Task | None = None

    def stop(signum: int) -> None:
        if stopping.is_set():
            return
        log.warning("worker: %s received, stopping", signal.Signals(signum).name)
        stopping.set()
        tasks.stop_claims()  # the runs claimed already finish, as jobs do
        if current is not None:
            current.cancel()  # Procrastinate stops gracefully when cancelled

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)

    options = {"install_signal_handlers": False}
    if concurrency:
        options["concurrency"] = concurrency
    backoff = BACKOFF_FIRST
    opened = False
    try:
        while not stopping.is_set():
            try:
                if not opened:
                    await app.open_async()
                    opened = True
                if not await _database_answers(app):
                    raise ConnectionError("the database does not answer")
                current = asyncio.create_task(app.run_worker_async(**options))
                started = loop.time()
                await current
                if stopping.is_set():
                    break
                reason = "its loop ended"
            except asyncio.CancelledError:
                if stopping.is_set():
                    break
                raise
            except Exception as exc:
                # (Procrastinate wraps psycopg's errors: the cause is looked at.)
                if not (is_connection_error(exc) or isinstance(exc, ConnectionError)):
                    raise
                reason = f"database unavailable: {_one_line(exc.__cause__ or exc)}"
                started = None
            finally:
                current = None
            if started is not None and loop.time() - started > 30:
                backoff = BACKOFF_FIRST  # it had been running fine
            log.warning("worker: stopped (%s); starting again in %.1f s", reason, backoff)
            print(f"yuxi worker: stopped ({reason}); starting again in {backoff:.1f} s",
                  file=sys.stderr, flush=True)
            try:
                await asyncio.wait_for(stopping.wait(), backoff)
            except TimeoutError:
                pass
            backoff = min(backoff * 2, BACKOFF_MAX)
    finally:
        if opened:
            try:
                await app.close_async()
            except Exception as exc:  # the database may be away: nothing to close cleanly
                log.warning("worker: closing the app: %s", _one_line(exc))
        try:
            await tasks.close_executor()
        except Exception as exc:
            log.warning("worker: closing the pools: %s", _one_line(exc))
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.run")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="runs executed at once (default: YUXI_WORKER_CONCURRENCY)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(levelname)s %(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    try:
        return asyncio.run(serve(args.concurrency))
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:  # fatal: say it, exit non-zero
        log.exception("worker: fatal error")
        print(f"yuxi worker: fatal error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
