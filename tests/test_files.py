"""Work made with other settings is set aside, never deleted (`common.files.resume_or_set_aside`),
the mechanism behind collect's parts, the draft corpora and the drafts being trained; and the
checks before a stage's work: files, writable outputs, one run per output folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from specstop.common.errors import SpecstopError
from specstop.common.files import check_file, check_writable, folder_lock, resume_or_set_aside


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_settings_resume_other_settings_move_aside_and_come_back(tmp_path, capsys):
    work, stale = tmp_path / "sweep" / "feature-l1", tmp_path / "stale"
    first, second = {"lr": 0.003}, {"lr": 0.01}
    assert not resume_or_set_aside(work, first, stale, "draft")  # nothing yet: a fresh start
    (work / "checkpoints").mkdir()
    (work / "checkpoints" / "last.ckpt").write_bytes(b"two hours of training")
    made = contents(work)
    assert resume_or_set_aside(work, first, stale, "draft")
    assert not resume_or_set_aside(work, second, stale, "draft")
    aside = list(stale.iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("feature-l1-")
    assert contents(aside[0]) == made and str(aside[0]) in capsys.readouterr().err
    assert [p.name for p in work.iterdir()] == ["recipe.json"]
    (work / "curve.csv").write_text("step\n1\n")
    assert resume_or_set_aside(work, first, stale, "draft")  # the first work comes back
    assert contents(work) == made
    assert [contents(p)["curve.csv"] for p in stale.iterdir()] == [b"step\n1\n"]


def test_a_folder_holding_only_its_recipe_is_not_kept(tmp_path):
    work, stale = tmp_path / "parts", tmp_path / "stale"
    resume_or_set_aside(work, {"depth": 8}, stale, "collect")
    assert not resume_or_set_aside(work, {"depth": 4}, stale, "collect")
    assert not stale.exists()


def test_one_run_at_a_time_holds_an_output_folder(tmp_path):
    out = tmp_path / "data" / "collect"
    with folder_lock(out, "collect"):
        with pytest.raises(SpecstopError, match=f"^{out}: another `specstop collect` run is "
                                                f"writing this folder"):
            with folder_lock(out, "collect"):
                pass
    with folder_lock(out, "collect"):  # released at the end of the block
        pass


@pytest.mark.parametrize("case, folder, expected", [
    ("file-where-a-folder-goes", True, "{p}: is a file, not a folder (key)"),
    ("folder-where-a-file-goes", False, "{p}: is a directory, not a file (key)"),
    ("under-a-file", False, "{p}/sub/x.json: cannot be created, {p} is a file (key)"),
])
def test_an_output_that_cannot_be_written_is_named(tmp_path, case, folder, expected):
    path = tmp_path / "out"
    path.mkdir() if case == "folder-where-a-file-goes" else path.write_text("x")
    target = path / "sub" / "x.json" if case == "under-a-file" else path
    with pytest.raises(SpecstopError) as err:
        check_writable(target, "key", folder)
    assert str(err.value) == expected.format(p=path)
    check_writable(tmp_path / "new" / "deeper", "key", folder=True)  # created later: fine


def test_a_folder_where_a_file_is_expected_says_so(tmp_path):
    with pytest.raises(SpecstopError, match=f"^{tmp_path}: is a directory, not a file$"):
        check_file(tmp_path, "never shown")
    with pytest.raises(SpecstopError, match="^absent: not found$"):
        check_file(tmp_path / "absent", "absent: not found")
