"""Schemathesis over /schema/openapi.json (issue 12): the examples, coverage,
fuzzing and stateful phases with a bounded number of examples, checks
`not_a_server_error` and `response_schema_conformance`, 0 failures. Its
generated strings rarely hold NUL or other control characters or huge
values: tests/e2e/schemathesis_hooks.py puts them into bodies and queries.

Against the real API (uvicorn) and a real worker on this test's database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from yuxi.services import accounts

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# Examples per operation and phase: bounded, so the run takes well under a minute.
MAX_EXAMPLES = int(os.environ.get("YUXI_SCHEMATHESIS_EXAMPLES", "12"))
SEED = os.environ.get("YUXI_SCHEMATHESIS_SEED", "12")


async def test_schemathesis_finds_no_server_error(api, worker, pool, tmp_path):
    key, _ = await accounts.create_key(pool, "fuzz", "fuzz")
    schemathesis = Path(sys.executable).parent / "schemathesis"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks",
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [str(schemathesis), "run", f"{api}/schema/openapi.json",
         "-H", f"Authorization: Bearer {key}",
         "--checks", "not_a_server_error,response_schema_conformance",
         "--phases", "examples,coverage,fuzzing,stateful",
         "--max-examples", str(MAX_EXAMPLES), "--seed", SEED,
         # An event stream never ends by itself: each of its cases would
         # wait for the request timeout (its errors are tested in test_sse).
         "--exclude-operation-id", "streamEvents",
         "--request-timeout", "10", "--no-color", "--warnings", "off",
         "--report-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    summary = result.stdout[-6000:]
    assert result.returncode == 0, summary
    assert "failures" not in summary.splitlines()[-1] or " 0 failures" in summary, summary
    assert "generated" in summary, summary
