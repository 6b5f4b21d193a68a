"""The web UI's state and layout modules have their own unit tests (node's
test runner, web/test/); `make test` runs them through this test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

WEB = Path(__file__).resolve().parents[2] / "web"


def test_web_unit_tests_pass():
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is missing: the web UI needs Node.js (make setup names it)")
    run = subprocess.run([node, "--test", "test/"], cwd=WEB, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "# fail 0" in run.stdout
