"""Run a program under cProfile with a CPU-time clock (time.process_time), so
waiting and being descheduled on a busy machine cost nothing in the profile.

    python -m benchmarks.profile_main OUT.prof (-m MODULE | SCRIPT) [ARGS...]

The profile is written when the program exits (also on SIGTERM: uvicorn and
`procrastinate worker` shut down gracefully on it, and uvicorn then raises
the signal again, which the handler installed here turns into an exit).
"""

from __future__ import annotations

import cProfile
import runpy
import signal
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

    # Programs that restore the handler they found and re-raise the signal
    # after their own shutdown (uvicorn) end here, with the profile written.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
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
