"""Work made with other settings is set aside, never deleted (`common.files.resume_or_set_aside`),
the mechanism behind collect's parts, the draft corpora and the drafts being trained."""

from __future__ import annotations

from pathlib import Path

from specstop.common.files import resume_or_set_aside


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
