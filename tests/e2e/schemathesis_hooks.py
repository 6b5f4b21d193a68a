"""Schemathesis hooks (SCHEMATHESIS_HOOKS) of tests/e2e/test_schemathesis.py:
generated strings rarely hold control characters or huge values, so some
generated bodies and query strings get one of NASTY in a string field."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

NASTY = [
    "\x00", "a\x00b", "\x00" * 64, "\x01\x02\x07\x08\x0b\x0c\x1b[31m\x7f",
    "\u0085\u2028\u2029", "\ufeff\ufffe\uffff", "\ud7ff\U0010ffff", "\t\r\n \r\n",
    "\\u0000", "x" * 250_000, "é" * 100_000, "\x00" + "y" * 2_000_000,
]


def _strings(value: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _strings(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _strings(v, (*path, i))]
    return []


def _poison(drawn: tuple) -> Any:
    value, nasty, pick, apply = drawn
    if not apply:
        return value
    paths = _strings(value)
    if isinstance(value, dict) and not paths:
        return value
    if not paths:
        return nasty if isinstance(value, str) else value
    path = paths[pick % len(paths)]
    if not path:
        return nasty
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = nasty
    return value


def _poisoned(strategy):
    return st.tuples(strategy, st.sampled_from(NASTY), st.integers(0, 50),
                     st.booleans()).map(_poison)


@schemathesis.hook
def before_generate_body(context, strategy):
    return _poisoned(strategy)


@schemathesis.hook
def before_generate_query(context, strategy):
    return _poisoned(strategy)
