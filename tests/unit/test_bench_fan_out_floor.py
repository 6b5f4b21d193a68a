"""The fan-out's floor line of `make bench-latency` (benchmarks/latency.py,
fan_out_floor): which chain it takes and which fan-out's floor it reports."""

from __future__ import annotations

from benchmarks.latency import fan_out_floor

# 64 children of 200 ms on 4 slots: the ideal is 3.2 s.
CHILDREN, DELAY = 64, 200


def test_nothing_recorded_gives_no_line():
    assert fan_out_floor(CHILDREN, DELAY, [], [10.0]) is None
    assert fan_out_floor(CHILDREN, DELAY, [([(0.0, 16)], 20.0)], []) is None


def test_the_chain_that_would_end_last_not_the_one_that_starts_last():
    # A one-child fragment starting last (its predecessor not matched) must
    # not stand for the fan-out: the 16-child chain from +90 ends later.
    chains = [(50.0, 16), (60.0, 16), (90.0, 16), (130.0, 1)]
    line = fan_out_floor(CHILDREN, DELAY, [(chains, 30.0)], [10.0])
    # 90 + 16 x 210 + 30 = 3480 ms
    assert "starts +90 ms, 16 children x (200 + 10.0) ms" in line
    assert "3.480 s, ratio 1.087" in line


def test_the_median_fan_out_and_the_higher_middle_of_an_even_number():
    def parts(start: float) -> tuple[list[tuple[float, int]], float]:
        return ([(start, 16)], 20.0)

    three = fan_out_floor(CHILDREN, DELAY, [parts(100.0), parts(40.0), parts(70.0)], [10.0])
    assert "starts +70 ms" in three  # not the first recorded, not the worst
    four = fan_out_floor(CHILDREN, DELAY,
                         [parts(100.0), parts(40.0), parts(70.0), parts(80.0)], [10.0])
    assert "starts +80 ms" in four


def test_the_lone_cycle_is_the_mean_of_the_lone_chains_cycles():
    line = fan_out_floor(CHILDREN, DELAY, [([(0.0, 16)], 0.0)], [8.0, 12.0, 13.0])
    assert "(200 + 11.0) ms" in line
    assert "3.376 s" in line  # 16 x 211
