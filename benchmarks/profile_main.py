"""Run a program under cProfile with a CPU-time clock (time.process_time), so
waiting and being descheduled on a busy machine cost nothing in the profile.

    python -m benchmarks.profile_main OUT.prof (-m MODULE | SCRIPT) [ARGS...]

The profile is written when the program exits (also on SIGTERM, which is
turned into a normal exit by the programs profiled here: uvicorn and
`procrastinate worker` both shut down gracefully on it).
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out, rest = sys.argv[1], sys.argv[2:]
    if rest[0] == "-m":
        module, args = rest[1], rest[2:]
        sys.argv = [module, *args]

        def target() -> None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = rest[0], rest[1:]
        sys.argv = [script, *args]

        def target() -> None:
            runpy.run_path(script, run_name="__main__")

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        target()
    except SystemExit:
        pass
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
