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
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator
from unittest import mock

import pytest
import torch
import yaml

from specstop.common.files import folder_lock
from specstop.features import FEATURES
from specstop.collection import collection
from specstop.pipeline import cli
from specstop.pipeline.cli import STAGES, main

from conftest import write_chat_prompts
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
    params: dict = field(default_factory=dict)  # merged into the project's params.yaml (<tiny>
    # as a value is the tiny model folder)
    setup: Callable[[Path, Path], None] | None = None  # (project, tiny model folder)
    raw_params: str | None = None  # the params file's text instead
    during: Callable[[Path], ContextManager] | None = None  # held around the run (project)


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


def _fewer_layers(root: Path, tiny: Path) -> None:
    """A copy of the tiny model whose config has one layer of its two."""
    shutil.copytree(tiny, root / "fewer")
    config = json.loads((root / "fewer" / "config.json").read_text())
    (root / "fewer" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))


def _small_vocabulary_draft(root: Path, tiny: Path) -> None:
    """A draft with the target's tokenizer and 1,000 of its 49,152 vocabulary rows."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(root / "small-vocab")
    tokenizer.save_pretrained(root / "small-vocab")


def _prompt_rows(*requests: str) -> Callable[[Path, Path], None]:
    def write(root: Path, tiny: Path) -> None:
        (root / "qs.jsonl").write_text("".join(json.dumps({"q": r}) + "\n" for r in requests))
    return write


def _folders(*names: str) -> Callable[[Path, Path], None]:
    def make(root: Path, tiny: Path) -> None:
        for name in names:
            (root / name).mkdir(parents=True)
    return make


def _summary_not_json(root: Path, tiny: Path) -> None:
    (root / "data/train").mkdir(parents=True)
    (root / "data/train/summary.json").write_text("{not json\n")
    (root / "metrics/train.json").write_text("{}\n")


def _collect_prompts(root: Path, tiny: Path) -> None:
    write_chat_prompts(root / "data/prompts", tiny, {"train": ["one two three"],
                                                     "val": ["four five six"]})


def _read_only(*names: str) -> Callable[[Path], ContextManager]:
    """The folders `names` of the project take no new file for the block (chmod, or the
    immutable flag where the tests run as root); the test is skipped where neither holds."""
    def during(root: Path):
        return _read_only_folders([root / name for name in names])
    return during


@contextmanager
def _read_only_folders(folders: list[Path]) -> Iterator[None]:
    made: list[Path] = []
    try:
        for folder in folders:
            _set_read_only(folder, True)
            made.append(folder)
        yield
    finally:
        for folder in made:
            _set_read_only(folder, False)


def _set_read_only(folder: Path, on: bool) -> None:
    """chmod 555 / 755; as root, whom modes do not stop, the immutable flag."""
    if os.geteuid() != 0:
        folder.chmod(0o555 if on else 0o755)
        return
    try:
        subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        if on:
            pytest.skip("running as root without chattr: no folder can be made read-only")
        raise


def _collect_running(rank: int = 0, world: int = 1) -> Callable[[Path], ContextManager]:
    """Another collect run holds data/collect's lock; this one is rank `rank` of `world`."""
    @contextmanager
    def during(root: Path) -> Iterator[None]:
        with folder_lock(root / "data/collect", "collect"), \
                mock.patch.object(collection, "init_distributed", lambda: (rank, world)):
            yield
    return during


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
    # issue 30: data loss, silent successes, late or vague errors, tracebacks, concurrency
    "cache-dir-is-the-data-folder": Case(
        ["generate", "--prompt", "hi"], "data: holds other files, not a converted model (no "
        "model.safetensors); set models.cache_dir to a new or empty folder",
        _set("models", "cache_dir", "data")),
    "empty-params-file": Case(["train"], "params.yaml: no settings (empty, or only comments)",
                              raw_params=""),
    "comment-only-params-file": Case(["train"], "params.yaml: no settings",
                                     raw_params="# train:\n#   seed: 1\n"),
    "duplicate-key": Case(["train"], "params.yaml: not valid YAML at line 3, column 3 (key "
                          "'seed' given twice in one mapping)",
                          raw_params="train:\n  seed: 1\n  seed: 2\n"),
    "duplicate-section": Case(["train"], "params.yaml: not valid YAML at line 3, column 1 (key "
                              "'train' given twice", raw_params="train:\n  seed: 1\ntrain:\n"
                                                                "  label: soft\n"),
    "tab-in-yaml": Case(["train"], "params.yaml: not valid YAML at line 3, column 1 (a tab; "
                        "YAML indents with spaces)",
                        raw_params="train:\n  seed: 1\n\tlabel: soft\n"),
    "params-file-is-a-directory": Case(["--params", "conf", "train"],
                                       "conf: is a directory, not a file", setup=_folders("conf")),
    "gamma-deeper-than-max-depth": Case([*GEN, "--gamma", "9", "--max-depth", "8"],
                                        "--gamma: 9 levels do not fit in max_depth 8"),
    "target-config-with-fewer-layers": Case(
        ["generate", "--target", "fewer", "--prompt", "hi"], "fewer: the weights do not match "
        "config.json (9 weight tensors it has no place for, e.g. 'model.layers.1.",
        setup=_fewer_layers),
    "draft-with-a-smaller-vocabulary": Case(
        [*GEN[:3], "--draft", "small-vocab", *GEN[5:]], "draft 'small-vocab': a vocabulary of "
        "1000 tokens, smaller than the target's 49152", setup=_small_vocabulary_draft),
    "two-prompt-rows": Case(["prompts"], "prompts: the val split would be empty (2 distinct "
                            "prompts in all, cut by prompts.fractions) and stage draft reads it",
                            {"models": {"target": "<tiny>"},
                             "prompts": {"sources": [{"path": "qs.jsonl", "field": "q"}]}},
                            setup=_prompt_rows("Write a sort.", "Explain a heap.")),
    "no-decision-model-prompts": Case(
        ["prompts"], "prompts: the train split would be empty (8 distinct prompts in all, cut "
        "by prompts.fractions) and stage collect reads it",
        {"models": {"target": "<tiny>"},
         "prompts": {"fractions": {"draft": 0.5, "train": 0, "val": 0.25, "test": 0.25},
                     "sources": [{"path": "qs.jsonl", "field": "q"}]}},
        setup=_prompt_rows(*[f"Task {i}." for i in range(8)])),
    "thirty-identical-prompt-rows": Case(
        ["prompts"], "prompts: the val split would be empty (1 distinct prompts in all",
        {"models": {"target": "<tiny>"},
         "prompts": {"sources": [{"path": "qs.jsonl", "field": "q"}]}},
        setup=_prompt_rows(*["Write a sort."] * 30)),
    "prompt-file-is-a-directory": Case(["prompts"], "qs.jsonl: is a directory, not a file",
                                       {"models": {"target": "<tiny>"}, "prompts": {
                                           "sources": [{"path": "qs.jsonl", "field": "q"}]}},
                                       setup=_folders("qs.jsonl")),
    "stop-model-is-a-directory": Case([*GEN, "--stop-model", "models"],
                                      "models: is a directory, not a file",
                                      setup=_folders("models")),
    "bench-decode-negative-prompts": Case(["bench-decode", "--prompts", "-1"],
                                          "argument --prompts: expected an integer >= 1, "
                                          "got '-1'"),
    "bench-decode-zero-prompts": Case(["bench-decode", "--prompts", "0"],
                                      "argument --prompts: expected an integer >= 1, got '0'"),
    "train-summary-not-json": Case(["export"], "data/train/summary.json: not valid JSON",
                                   setup=_summary_not_json),
    "bench-on-a-train-summary-not-json": Case(["bench"], "data/train/summary.json: not valid "
                                              "JSON", setup=_summary_not_json),
    "metrics-not-writable": Case(["train"], "metrics/train.json: cannot be written, metrics "
                                 "takes no new file", during=_read_only("metrics")),
    "data-not-writable": Case(["train"], "data/train: cannot be written, data takes no new file",
                              during=_read_only("data")),
    "costs-path-is-a-folder": Case(["prepare"], "data/costs: is a directory, not a file "
                                   "(costs.path)", _set("costs", "path", "data/costs"),
                                   setup=_folders("data/costs")),
    "postgres-without-its-driver": Case(
        ["train"], "MLflow tracking URI postgresql://me@localhost/mlflow: its database driver is "
        "not installed", _set("mlflow", "tracking_uri", "postgresql://me@localhost/mlflow")),
    "file-tracking-uri": Case(["export"], "MLflow tracking URI file:./mlruns: MLflow refuses a "
                              "folder store unless MLFLOW_ALLOW_FILE_STORE=true",
                              _set("mlflow", "tracking_uri", "file:./mlruns")),
    "bench-method-typo-refused-by-prepare": Case(
        ["prepare"], "params.yaml: bench.methods[0]: expected one of 'ar', ",
        _set("bench", "methods", ["nope"])),
    "second-collect-run": Case(["collect"], "data/collect: another `specstop collect` run is "
                               "writing this folder", setup=_collect_prompts,
                               during=_collect_running()),
    "second-torchrun-collect": Case(["collect"], "data/collect: another `specstop collect` run "
                                    "is writing this folder", setup=_collect_prompts,
                                    during=_collect_running(rank=0, world=2)),
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
                     "train": {"families": ["logistic"]}}, _tiny(case.params, tiny_target))))
    argv = [str(tiny_target) if a == "<tiny>" else a for a in case.argv]
    with case.during(tmp_path) if case.during else nullcontext():
        before = _snapshot(tmp_path)
        capsys.readouterr()
        start = time.perf_counter()
        try:
            code = main(["--params", str(params), *argv])
        except SystemExit as exit:  # a usage error, from argparse
            code = exit.code
        seconds = time.perf_counter() - start
        after = _snapshot(tmp_path)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("specstop: error: "), err
    assert case.expected in lines[0], lines[0]
    assert seconds < 30, seconds  # before any work: no model conversion, no decoding
    assert after == before
    assert not (tmp_path / "data" / "models").exists()  # nothing converted


def _tiny(value, tiny: Path):
    """`value` with every "<tiny>" string in it the tiny model folder."""
    if isinstance(value, dict):
        return {k: _tiny(v, tiny) for k, v in value.items()}
    if isinstance(value, list):
        return [_tiny(v, tiny) for v in value]
    return str(tiny) if value == "<tiny>" else value


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _deep_merge(base[key], value) if isinstance(value, dict) and \
            isinstance(base.get(key), dict) else value
    return out


# One bad value per params section: every stage refuses each of them, those of the sections
# only later stages read included (`bench.methods` is refused by `specstop prepare`).
BAD_SECTIONS: dict[str, tuple[dict, str]] = {
    "models": (_set("models", "dtype", "fp8"), "models.dtype: expected one of 'auto'"),
    "costs": (_set("costs", "widths", [0]), "costs.widths[0]: expected an integer >= 1"),
    "decode": (_set("decode", "gamma", 9), "decode: gamma: 9 levels do not fit in max_depth 8"),
    "prompts": (_set("prompts", "fractions", {"train": 1.0}), "prompts.fractions: expected a "
                "mapping with keys draft, train, val, test"),
    "draft": (_set("draft", "train", "lr", 0), "draft.train.lr: expected a number > 0"),
    "mlflow": (_set("mlflow", "experiment", ""), "mlflow.experiment: expected a string"),
    "collect": (_set("collect", "splits", ["dev"]), "collect.splits[0]: expected one of"),
    "train": (_set("train", "label", "fuzzy"), "train.label: expected one of 'hard', 'soft'"),
    "export": (_set("export", "tolerance", -1), "export.tolerance: expected a number >= 0"),
    "bench": (_set("bench", "methods", ["nope"]), "bench.methods[0]: expected one of 'ar'"),
    "profiles": (_set("profiles", "fast", "bench", "sampling_methods", ["nope"]),
                 "profiles.fast.bench.sampling_methods[0]: expected one of 'ar'"),
}


@pytest.mark.parametrize("section", list(BAD_SECTIONS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_checks_every_section_before_any_work(stage, section, tmp_path, capsys,
                                                           monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError(f"stage {stage} started with a bad {section} section")

    monkeypatch.setattr(cli, "timed_stage", no_work)
    monkeypatch.setattr(cli, "check_outputs", no_work)
    raw, expected = BAD_SECTIONS[section]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main(["--params", str(tmp_path / "params.yaml"), stage]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"params.yaml: {expected}" in err, err


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
