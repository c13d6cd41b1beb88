"""Bad inputs at the CLI: each ends `specstop <stage>` with exit code 2 and one stderr line,
`specstop: error: ...`, naming the problem and the file, key, flag or URI, within seconds, and
leaves the outputs already there byte-identical (the table `CASES`).

Covered elsewhere, not repeated here: a stop model of another feature schema
(test_export.test_generate_with_a_stop_model), prompt files with bad rows skipped and counted
(test_prompts.test_cli_prompts_end_to_end, test_prompts.test_local_file_bad_rows_are_counted),
parts unit by unit (test_collect.test_reading_bad_parts_gives_clear_errors).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml

from specstop.features import FEATURES
from specstop.pipeline.cli import main

from stop_models import write_stop_model
from synthetic_rows import make_collect

FAST_S = 8.0  # "within seconds": the probe waits 3 s at most; the rest is Python on a busy CPU


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specstop(tmp_path: Path, capsys, stage: str, tracking_uri: str,
             collect: Path | None = None) -> tuple[int, str, float]:
    """(exit code, the one stderr line, seconds) of `specstop --params <file> <stage>`."""
    collect = collect or tmp_path / "collect"
    params = {"mlflow": {"tracking_uri": tracking_uri, "experiment": "faults"},
              "train": {"data": str(collect), "out": str(tmp_path / "train"),
                        "metrics": str(tmp_path / "metrics" / "train.json"),
                        "plots": str(tmp_path / "metrics" / "plots"), "families": ["logistic"]},
              "export": {"train": str(tmp_path / "train"), "data": str(collect),
                         "out": str(tmp_path / "export"),
                         "metrics": str(tmp_path / "metrics" / "export.json")},
              "draft": {"out": str(tmp_path / "draft"),
                        "sweep": [{"family": "feature", "layers": 1, "vocab": 64}]}}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    capsys.readouterr()
    start = time.perf_counter()
    code = main(["--params", str(path), stage])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("specstop: error: "), lines[0]
    return code, lines[0], seconds


@pytest.fixture(autouse=True)
def no_env_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no test asks the real hub
    monkeypatch.chdir(tmp_path)


def test_train_on_a_truncated_part_names_the_part(tmp_path, capsys):
    folder = make_collect(tmp_path / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    part = folder / "parts" / "val-00000.parquet"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    code, line, _ = specstop(tmp_path, capsys, "train", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert code == 2
    assert f"{part}: corrupt or truncated Parquet file" in line


@pytest.mark.parametrize("stage", ["train", "export", "draft"])
def test_unreachable_tracking_server_fails_fast(tmp_path, capsys, stage):
    uri = f"http://127.0.0.1:{free_port()}"
    code, line, seconds = specstop(tmp_path, capsys, stage, uri)
    assert code == 2 and seconds < FAST_S, (code, seconds)
    assert f"MLflow tracking server {uri} is not reachable" in line
    assert "mlflow server" in line and "mlflow.tracking_uri" in line


@pytest.mark.parametrize("case", ["folder-not-creatable", "not-a-database", "unknown-scheme"])
def test_unusable_tracking_store_fails_fast(tmp_path, capsys, case):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder, not a database\n")
    uri, expected = {
        "folder-not-creatable": (f"sqlite:///{blocker / 'sub' / 'mlflow.db'}",
                                 f"cannot create the folder {blocker / 'sub'}"),
        "not-a-database": (f"sqlite:///{blocker}", f"{blocker} is not an SQLite database"),
        "unknown-scheme": ("mlfow://localhost:5000", "unknown scheme 'mlfow'"),
    }[case]
    code, line, seconds = specstop(tmp_path, capsys, "train", uri)
    assert code == 2 and seconds < FAST_S, (code, seconds)
    assert uri in line and expected in line and "mlflow.tracking_uri" in line


# ---------------------------------------------------------------------------------------------
# The table: every bad input of the CLI and the stages, run in a project folder that already
# holds outputs.  Each case must end with exit code 2 and one stderr line `specstop: error: ...`
# naming the file, key or flag, no traceback, and leave data/ and metrics/ byte-identical.

@dataclass(frozen=True)
class Case:
    argv: list[str]  # after `specstop --params params.yaml`; <tiny> is a tiny model folder
    expected: str  # in the error line; <root> is the project folder
    params: dict = field(default_factory=dict)  # merged into the project's params.yaml
    setup: Callable[[Path, Path], None] | None = None  # (project, tiny model folder)
    raw_params: str | None = None  # the params file's text instead


def _set(*keys_value) -> dict:
    *keys, value = keys_value
    out: dict = value
    for key in reversed(keys):
        out = {key: out}
    return out


def _corrupt_weights(root: Path, tiny: Path) -> None:
    shutil.copytree(tiny, root / "broken")
    weights = root / "broken" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _empty_folder(root: Path, tiny: Path) -> None:
    (root / "empty").mkdir()


def _wrong_shape_stop_model(root: Path, tiny: Path) -> None:
    write_stop_model(root / "wide.pt", torch.jit.script(torch.nn.Linear(len(FEATURES), 2)))
    write_stop_model(root / "narrow.pt", torch.jit.script(torch.nn.Linear(5, 1)))


def _zero_costs(root: Path, tiny: Path) -> None:
    path = root / "data/collect/costs.json"
    costs = json.loads(path.read_text())
    costs["target"]["seconds"] = {k: 0.0 for k in costs["target"]["seconds"]}
    path.write_text(json.dumps(costs))


def _empty_costs(root: Path, tiny: Path) -> None:
    path = root / "data/collect/costs.json"
    costs = json.loads(path.read_text())
    costs["draft"]["seconds"] = {}
    path.write_text(json.dumps(costs))


def _a_file(root: Path, tiny: Path) -> None:
    (root / "a-file").write_text("not a folder\n")


GEN = ["generate", "--target", "<tiny>", "--draft", "<tiny>", "--dtype", "float32",
       "--max-new-tokens", "4", "--prompt", "hi"]
CASES: dict[str, Case] = {
    # params.yaml: one schema, unknown keys, types, ranges, profiles
    "not-yaml": Case(["train"], "params.yaml: not valid YAML", raw_params="train: [\n"),
    "misspelt-section": Case(["train"], "params.yaml: trian: unknown key",
                             {"trian": {"families": ["mlp"]}}),
    "unknown-collect-key": Case(["collect"], "params.yaml: collect.part_sise: unknown key",
                                _set("collect", "part_sise", 2)),
    "unknown-models-key": Case(["collect"], "params.yaml: models.drfat: unknown key",
                               _set("models", "drfat", "layers:1")),
    "unknown-decode-key": Case(GEN, "params.yaml: decode.gama: unknown key",
                               _set("decode", "gama", 3)),
    "unknown-prompts-key": Case(["prompts"], "params.yaml: prompts.seeed: unknown key",
                                _set("prompts", "seeed", 1)),
    "unknown-family-hyperparameter": Case(
        ["train"], "params.yaml: train.lightgbm.num_leafs: unknown key",
        _set("train", "lightgbm", "num_leafs", 7)),
    "int-as-word": Case(["train"], "params.yaml: train.mlp.max_epochs: expected an integer >= 1, "
                        "got 'three'", _set("train", "mlp", "max_epochs", "three")),
    "float-as-word": Case(["export"], "params.yaml: export.tolerance: expected a number >= 0, "
                          "got 'tight'", _set("export", "tolerance", "tight")),
    "grid-as-word": Case(["train"], "params.yaml: train.threshold_grid: expected an integer >= 2",
                         _set("train", "threshold_grid", "many")),
    "negative-iterations": Case(["train"], "train.rho_iterations: expected an integer >= 1, "
                                "got -1", _set("train", "rho_iterations", -1)),
    "negative-fraction": Case(["train"], "train.early_stop_fraction: expected a number > 0 and "
                              "< 1, got -0.5", _set("train", "early_stop_fraction", -0.5)),
    "fraction-over-one": Case(["train"], "train.early_stop_fraction: expected a number > 0 and "
                              "< 1, got 1.5", _set("train", "early_stop_fraction", 1.5)),
    "zero-part-size": Case(["collect"], "collect.part_size: expected an integer >= 1, got 0",
                           _set("collect", "part_size", 0)),
    "unknown-family": Case(["train"], "train.families[0]: expected one of 'logistic'",
                           _set("train", "families", ["logistc"])),
    "bad-precision": Case(["draft"], "draft.train.precision: expected one of 'auto'",
                          _set("draft", "train", "precision", "bf16")),
    "bad-sweep-entry": Case(["draft"], "draft.sweep[0].layers: required key missing",
                            _set("draft", "sweep", [{"family": "feature"}])),
    "fused-compact-draft": Case(["draft"], "draft.sweep[0]: fuse: only a feature head reads "
                                "the target's layers", _set("draft", "sweep", [
                                    {"family": "compact", "layers": 1, "fuse": True}])),
    "domains-not-summing-to-one": Case(["draft"], "draft: domains: the fractions must sum to 1, "
                                       "got 0.9", _set("draft", "domains",
                                                       {"humaneval": 0.5, "magpie": 0.4})),
    "bad-profile-value": Case(["train"], "params.yaml: profiles.tiny.train.mlp.max_epochs: "
                              "expected an integer >= 1, got 0",
                              _set("profiles", "tiny", "train", "mlp", "max_epochs", 0)),
    "bad-prompt-source": Case(["prompts"], "params.yaml: prompts.sources[0]: give either field",
                              _set("prompts", "sources", [{"path": "qs.json"}])),
    "bad-fractions": Case(["prompts"], "params.yaml: prompts.fractions",
                          _set("prompts", "fractions", {"train": 0.5, "val": 0.1})),
    # CLI flags: checked by the same schema, named as flags
    "nan-temperature": Case([*GEN, "--temperature", "nan"],
                            "--temperature: expected 0 (greedy) or a number in [0.001, 100], "
                            "got nan"),
    "tiny-temperature": Case([*GEN, "--temperature", "1e-40"], "--temperature: expected 0"),
    "huge-seed": Case([*GEN, "--seed", str(2**70)], "--seed: expected an integer >= 0 and <= "),
    "bad-policy": Case([*GEN, "--policy", "clever"], "--policy: expected one of 'fixed'"),
    "invalid-utf8-prompt": Case([*GEN[:-1], "caf\udce9"], "the prompt is not valid UTF-8"),
    # model and stop-model files
    "typo-draft-folder": Case(["collect"], "data/draft/defualt: not found (run `specstop draft`",
                              _set("models", "draft", "data/draft/defualt")),
    "relative-draft-absent": Case([*GEN[:3], "--draft", "nope_folder", *GEN[5:]],
                                  "'nope_folder' is neither a local folder nor a cached hub "
                                  "model, and the hub is not reachable (HF_HUB_OFFLINE is set)"),
    "corrupt-weights": Case(["generate", "--target", "broken", "--prompt", "hi"],
                            "model.safetensors: corrupt or truncated weights",
                            setup=_corrupt_weights),
    "empty-model-folder": Case(["generate", "--target", "empty", "--prompt", "hi"],
                               "empty: not a model folder (no config.json)", setup=_empty_folder),
    "stop-model-two-outputs": Case([*GEN, "--stop-model", "wide.pt"], "wide.pt: the model "
                                   "returns", setup=_wrong_shape_stop_model),
    "stop-model-narrow-input": Case([*GEN, "--stop-model", "narrow.pt"], "narrow.pt: the model "
                                    "does not accept [N, ", setup=_wrong_shape_stop_model),
    # stage inputs
    "bench-before-train": Case(["bench"], "data/train/summary.json: not found (run "
                               "`specstop train`"),
    "zero-cost-timings": Case(["train"], "costs.json: not a cost model", setup=_zero_costs),
    "empty-cost-timings": Case(["train"], "costs.json: not a cost model", setup=_empty_costs),
    "workspace-into-a-file": Case(["workspace", "a-file"], "a-file: exists and is not a folder",
                                  setup=_a_file),
}


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for folder in ("data", "metrics") for p in sorted((root / folder).rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_touches_no_output(name, tmp_path, capsys, tiny_target):
    case = CASES[name]
    make_collect(tmp_path / "data" / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    (tmp_path / "data" / "draft" / "default").mkdir(parents=True)
    (tmp_path / "data" / "draft" / "default" / "head.safetensors").write_bytes(b"logged head")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "draft.json").write_text('{"alpha": 0.5}\n')
    if case.setup is not None:
        case.setup(tmp_path, tiny_target)
    params = tmp_path / "params.yaml"
    params.write_text(case.raw_params if case.raw_params is not None else yaml.safe_dump(
        _deep_merge({"models": {"draft": "data/draft/default"},
                     "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
                     "train": {"families": ["logistic"]}}, case.params)))
    before = _snapshot(tmp_path)
    argv = [str(tiny_target) if a == "<tiny>" else a for a in case.argv]
    capsys.readouterr()
    start = time.perf_counter()
    code = main(["--params", str(params), *argv])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("specstop: error: "), err
    assert case.expected in lines[0], lines[0]
    assert seconds < 30, seconds  # before any work: no model conversion, no decoding
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / "data" / "models").exists()  # nothing converted


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _deep_merge(base[key], value) if isinstance(value, dict) and \
            isinstance(base.get(key), dict) else value
    return out


def test_ctrl_c_exits_130_in_one_line_and_keeps_outputs(tmp_path, capsys, monkeypatch):
    from specstop.pipeline import train

    make_collect(tmp_path / "data" / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    before = _snapshot(tmp_path)

    def interrupted(params) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    capsys.readouterr()
    assert main(["train"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specstop: interrupted") and \
        "Traceback" not in err
    assert _snapshot(tmp_path) == before
