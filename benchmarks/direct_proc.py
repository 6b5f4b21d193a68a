"""The direct graph in a process of its own, for the paired rounds.

    python -m benchmarks.direct_proc <the bench's options>

Reads commands on stdin, one per line, and answers each on stdout:
`warmup` -> `ok`; `round <r>` -> the round's runs/s; `frozen <r>` -> the
same with the startup heap frozen as the worker's is (yuxi.heap), then
unfrozen. A clean process (only
the graph, a plain heap, its own event loop), as the direct phase (b) is,
while the bench process holds the system phase's clients and results.
"""

from __future__ import annotations

import asyncio
import gc
import sys

from benchmarks.run import DirectGraph, parse_args, round_indexes, run_concurrently
from yuxi.heap import freeze_startup_heap


async def serve(argv: list[str]) -> None:
    opts = parse_args(argv)
    async with DirectGraph(opts) as direct:
        print("ready", flush=True)
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            command, _, arg = line.partition(" ")
            if command == "warmup":
                await run_concurrently([-1 - i for i in range(opts.warmup)], opts.concurrency,
                                       direct.invoke)
                print("ok", flush=True)
            elif command == "round":
                print(f"{await direct.round(round_indexes(opts, int(arg))):.3f}", flush=True)
            elif command == "frozen":
                freeze_startup_heap()
                try:
                    rate = await direct.round(round_indexes(opts, int(arg)))
                finally:
                    gc.unfreeze()
                print(f"{rate:.3f}", flush=True)
            else:
                raise SystemExit(f"unknown command {line!r}")


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
