"""Memory of one API process with many idle SSE subscribers.

    python -m benchmarks.sse_memory [--subscribers N] [--database-url URL]

Starts the real API (uvicorn, `yuxi.cli.api_command`) on a fresh database
(default `yuxi_bench_sse` on the server of $YUXI_BENCH_DATABASE_URL or
127.0.0.1:5432; DROPPED and recreated), opens N event streams of one session
that stay idle (keepalives only), and prints the API process's resident
memory before, with the N subscribers, and the difference per subscriber.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from benchmarks import run as bench


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def main_async(url: str, n: int) -> None:
    from yuxi.cli import api_command

    await bench.fresh_database(url)
    key, _, agent_id = await bench.create_key_and_agent(url)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("YUXI_")}
    env.update(YUXI_DATABASE_URL=url, YUXI_SSE_KEEPALIVE_SECONDS="15")
    log = tempfile.TemporaryFile()
    api = subprocess.Popen(api_command("127.0.0.1", port), env=env, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/api/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("sse_memory: the API did not start")
            time.sleep(0.1)
        proc = psutil.Process(api.pid)
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits,
                                     timeout=60) as c:
            session = (await c.post("/api/sessions", json={"agent_id": str(agent_id)})).json()
            path = f"/api/sessions/{session['id']}/events"
            # Warm the process up with a few streams first (imports, pools).
            for _ in range(3):
                async with c.stream("GET", path):
                    pass
            await asyncio.sleep(1)
            before = proc.memory_info().rss
            streams = []
            for _ in range(n):
                cm = c.stream("GET", path)
                response = await cm.__aenter__()
                assert response.status_code == 200, response.status_code
                streams.append(cm)
            await asyncio.sleep(2)
            during = proc.memory_info().rss
            for cm in streams:
                await cm.__aexit__(None, None, None)
            await asyncio.sleep(2)
            after = proc.memory_info().rss
    finally:
        api.terminate()
        try:
            api.wait(10)
        except subprocess.TimeoutExpired:
            api.kill()
    mib = 1024 * 1024
    print(f"API process RSS: {before / mib:.1f} MiB before, {during / mib:.1f} MiB with "
          f"{n} idle subscribers ({(during - before) / n / 1024:.1f} KiB each), "
          f"{after / mib:.1f} MiB after they left")


def main() -> None:
    from yuxi import db

    parser = argparse.ArgumentParser(prog="python -m benchmarks.sse_memory")
    parser.add_argument("--subscribers", type=int, default=1000)
    default = db.with_database(os.environ.get("YUXI_BENCH_DATABASE_URL", bench.DEFAULT_URL),
                               "yuxi_bench_sse")
    parser.add_argument("--database-url", default=default)
    args = parser.parse_args()
    asyncio.run(main_async(args.database_url, args.subscribers))


if __name__ == "__main__":
    sys.exit(main())
