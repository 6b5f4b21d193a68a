"""Workdir confinement of the file tools (no database)."""

from __future__ import annotations

import uuid

import pytest

from yuxi.runtime.sandbox_tools import confined
from yuxi.runtime.tools import ToolContext, ToolError
from yuxi.services.sandbox import locate


@pytest.fixture
def ctx(tmp_path):
    box = locate(tmp_path, uuid.uuid4(), 1)
    box.workdir.mkdir(parents=True)
    (box.workdir / "sub").mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    (box.workdir / "escape").symlink_to(tmp_path / "secret.txt")
    (box.workdir / "inside-link").symlink_to(box.workdir / "sub")
    return ToolContext(pool=None, run_id=uuid.uuid4(), token=uuid.uuid4(), call_id="c",
                       sandbox=box)


@pytest.mark.parametrize("path", ["a.txt", "sub/b.txt", ".", "./sub", "inside-link/x"])
def test_paths_inside_the_workdir_are_allowed(ctx, path):
    assert ctx.sandbox.workdir.resolve() in [confined(ctx, path), *confined(ctx, path).parents]


@pytest.mark.parametrize("path", ["/etc/passwd", "../secret.txt", "sub/../../x", "escape",
                                  "", "   ", 5])
def test_paths_leading_out_are_refused(ctx, path):
    with pytest.raises(ToolError) as err:
        confined(ctx, path)
    assert err.value.code in ("path_outside_workdir", "invalid_arguments")
