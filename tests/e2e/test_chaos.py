"""The short `make chaos` (benchmarks/chaos.py) as a test (issue 12): a
fan-out workload with side-effecting tools over real API and worker
processes on a private embedded PostgreSQL, with 10 SIGKILLs of random
worker and API processes, one PostgreSQL restart and one termination of
every yuxi backend. Everything must be zero: lost turns, duplicated effects,
event gaps and duplicates, runs stuck past their lease; and it drains."""

from __future__ import annotations

import pytest

from benchmarks.chaos import Options, run_chaos

pytestmark = pytest.mark.e2e


def test_short_chaos_loses_nothing(tmp_path):
    report = run_chaos(Options(trees=10, kills=10, workers=2, apis=2, fault_interval=1.2,
                               drain_timeout=150, seed=12, log_dir=tmp_path, verbose=False))
    text = report.text()
    assert report.kills == 10 and report.pg_restarts == 1, text
    assert report.backend_terminations == 1, text
    assert report.drained, text
    assert report.lost_turns == 0 and report.inputs_without_turn == 0, text
    assert report.turns == 30, text  # 10 roots, 2 children each
    assert report.effect_calls == report.effect_rows == 20, text
    assert report.duplicated_effects == 0, text
    assert report.children_per_create_session_over_1 == 0, text
    assert report.event_gaps == 0 and report.event_duplicates == 0, text
    assert report.runs_stuck_past_lease == 0, text
    assert report.ok, text
