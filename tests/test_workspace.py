"""Profiles of params.yaml and workspace copies (`specstop workspace`)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from specstop.common.errors import SpecstopError
from specstop.pipeline.cli import main
from specstop.common.params import apply_profile, validate
from specstop.pipeline.params import read_params_file
from specstop.pipeline.workspace import make_workspace

from conftest import ROOT

FEATURE, COMPACT = {"family": "feature", "layers": 1}, {"family": "compact", "layers": 2}
PARAMS = {"draft": {"corpus": {"temperatures": [0.0, 0.7, 1.0], "top_k": 16}, "sweep": [FEATURE, COMPACT]},
          "bench": {"prompts": 8},
          "profiles": {"small": {"draft": {"corpus": {"temperatures": [0.0]},
                                           "sweep": [COMPACT]}}}}


def test_profile_merges_mappings_and_replaces_the_rest():
    assert apply_profile(PARAMS, "small") == {
        "draft": {"corpus": {"temperatures": [0.0], "top_k": 16}, "sweep": [COMPACT]},
        "bench": {"prompts": 8}}
    assert PARAMS["draft"]["corpus"]["temperatures"] == [0.0, 0.7, 1.0]  # the input is left alone


@pytest.mark.parametrize("profiles, name, message", [
    ({"small": {}}, "large", "no profile 'large'"),
    ({"small": {"benhc": {"prompts": 1}}}, "small", r"profiles\.small\.benhc: unknown key"),
    ({"small": {"bench": {"prompts": 0}}}, "small",
     r"profiles\.small\.bench\.prompts: expected an integer >= 1, got 0"),
    ({"small": [1]}, "small", r"profiles\.small: expected a mapping"),
])
def test_bad_profiles_are_named(profiles, name, message):
    with pytest.raises(SpecstopError, match=message):
        validate({**PARAMS, "profiles": profiles})
        apply_profile({**PARAMS, "profiles": profiles}, name)


def test_the_smoke_profile_applies_to_this_params_file():
    params = read_params_file(ROOT / "params.yaml")
    validate(params)  # the profiles too
    smoke = apply_profile(params, "smoke")
    assert set(smoke) == set(params) - {"profiles"}
    assert smoke["bench"]["prompts"] < params["bench"]["prompts"]
    assert smoke["models"] == params["models"]


def _git_project(folder):
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "out.bin").write_text("an output")
    (folder / "code.py").write_text("x = 1\n")
    (folder / "notes.txt").write_text("untracked, not ignored\n")
    (folder / "scratch.log").write_text("ignored\n")
    (folder / ".gitignore").write_text("*.log\n")
    (folder / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run(["git", "add", "code.py", ".gitignore", "params.yaml", "data/out.bin"],
                   cwd=folder, check=True)
    return folder


def test_workspace_copies_the_project_files_not_outputs(tmp_path):
    root = _git_project(tmp_path / "root")
    dest = make_workspace(root, tmp_path / "ws", "small", PARAMS)
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert copied == [".dvc/config.local", ".gitignore", "code.py", "notes.txt", "params.yaml"]
    assert read_params_file(dest / "params.yaml") == apply_profile(PARAMS, "small")


def test_workspace_cli_refuses_a_folder_in_use(tmp_path, capsys):
    root = _git_project(tmp_path / "root")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "keep.txt").write_text("someone's file")
    assert main(["--params", str(root / "params.yaml"), "workspace", str(tmp_path / "ws"),
                 "--profile", "small"]) == 2
    assert "workspace folder exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "ws" / "keep.txt").read_text() == "someone's file"
