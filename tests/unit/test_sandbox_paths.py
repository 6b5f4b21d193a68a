"""Workdir confinement of the file tools on the host (YUXI_SANDBOX=host; no
database). Confined, the sandbox agent applies the same rules inside."""

from __future__ import annotations

import uuid

import pytest

from yuxi.runtime.confine import host_path
from yuxi.runtime.tools import ToolError
from yuxi.services.sandbox import locate


@pytest.fixture
def box(tmp_path):
    box = locate(tmp_path, uuid.uuid4(), 1)
    box.workdir.mkdir(parents=True)
    (box.workdir / "sub").mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    (box.workdir / "escape").symlink_to(tmp_path / "secret.txt")
    (box.workdir / "inside-link").symlink_to(box.workdir / "sub")
    return box


@pytest.mark.parametrize("path", ["a.txt", "sub/b.txt", ".", "./sub", "inside-link/x"])
def test_paths_inside_the_workdir_are_allowed(box, path):
    assert box.workdir.resolve() in [host_path(box, path), *host_path(box, path).parents]


@pytest.mark.parametrize("path", ["/etc/passwd", "../secret.txt", "sub/../../x", "escape",
                                  "", "   ", 5])
def test_paths_leading_out_are_refused(box, path):
    with pytest.raises(ToolError) as err:
        host_path(box, path)
    assert err.value.code in ("path_outside_workdir", "invalid_arguments")
