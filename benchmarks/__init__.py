"""Benchmarks of Yuxi sessions (`python -m benchmarks.run`, or `make bench`).

They are reports, never tests: they print numbers and exit 0 unless the
benchmark itself could not run.
"""
