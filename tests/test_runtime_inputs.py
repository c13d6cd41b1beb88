"""Every bad runtime input is one SpecstopError line naming the file (or name) and the problem:
model folders, draft metadata and heads, stop models, cost tables, workspaces, prompts.

Library functions are called directly; the same kinds of input through the CLI, in a project
whose outputs must stay untouched, are cases of test_faults.py's table."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specstop.common.errors import SpecstopError
from specstop.decoder import load, model_files
from specstop.decoder.costs import VerifyCosts
from specstop.decoder.loop import DecodeConfig
from specstop.drafts.families import build_feature_head
from specstop.drafts.store import (DRAFT_META_FILE, HEAD_WEIGHTS, load_feature_head, read_meta,
                                   save_draft)
from specstop.decoder.load import convert_embedded, load_model, load_tokenizer
from specstop.decoder.runtime import check_utf8
from specstop.drafts.loading import load_runtime
from specstop.decoder.stop_model import load_stop_model
from specstop.features import FEATURES
from specstop.common.errors import DataError
from specstop.decoder.costs import CostModel
from specstop.pipeline.workspace import make_workspace

from conftest import TINY_CONTEXT, tiny_llama
from stop_models import write_stop_model

WEIGHTS = "model.safetensors"


def one_line(err: pytest.ExceptionInfo, *expected: str) -> None:
    """The error is one line holding every expected piece."""
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    for piece in expected:
        assert piece in message, message


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model folder, free to corrupt."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


# --- model folders -----------------------------------------------------------------------------

def _truncate(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _rewrite_weights(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def rewrite(folder: Path) -> None:
        state = load_file(folder / WEIGHTS)
        change(state)
        save_file(state, folder / WEIGHTS, metadata={"format": "pt"})
    return rewrite


def _shard_index(folder: Path) -> None:
    names = list(load_file(folder / WEIGHTS))
    (folder / WEIGHTS).unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}))


def _remove(*names: str) -> Callable[[Path], None]:
    return lambda folder: [(folder / n).unlink() for n in names]


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


def _empty(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()


# case -> (how the folder is damaged, what the error says; {f} is the folder)
MODEL_FOLDERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated-weights": (_truncate, "{f}/model.safetensors: corrupt or truncated weights"),
    "garbage-weights": (lambda f: (f / WEIGHTS).write_bytes(b"not weights" * 9),
                        "{f}/model.safetensors: corrupt or truncated weights"),
    "empty-weights": (lambda f: (f / WEIGHTS).write_bytes(b""),
                      "{f}/model.safetensors: corrupt or truncated weights"),
    "no-weights": (_remove(WEIGHTS), "{f}: no weights (model.safetensors or pytorch_model.bin)"),
    "no-config": (_remove("config.json"), "{f}: not a model folder (no config.json)"),
    "empty-folder": (_empty, "{f}: not a model folder (no config.json)"),
    "config-not-json": (lambda f: (f / "config.json").write_text("{"),
                        "{f}/config.json: not a usable model config"),
    "config-no-model-type": (lambda f: (f / "config.json").write_text("{}"),
                             "{f}/config.json: not a usable model config (Unrecognized model"),
    "no-tokenizer": (_remove("tokenizer.json", "tokenizer_config.json"), "{f}: no tokenizer"),
    "missing-shard": (_shard_index, "{f}/model-00001-of-00002.safetensors: weights file missing"),
    "missing-tensor": (_rewrite_weights(lambda s: s.pop("model.norm.weight")),
                       "{f}: the weights do not match config.json (1 of its tensors missing, "
                       "e.g. 'model.norm.weight')"),
    "tensor-of-another-shape": (
        _rewrite_weights(lambda s: s.update({"model.norm.weight": torch.ones(3)})),
        "{f}: the weights do not match config.json (1 of its tensors of another shape"),
    "config-with-fewer-layers": (
        _edit_config(num_hidden_layers=1), "{f}: the weights do not match config.json (9 "
        "weight tensors it has no place for, e.g. 'model.layers.1.input_layernorm.weight')"),
}


@pytest.mark.parametrize("case", MODEL_FOLDERS)
def test_a_damaged_model_folder_is_named(model_copy: Path, case: str):
    damage, expected = MODEL_FOLDERS[case]
    damage(model_copy)
    with pytest.raises(SpecstopError) as err:
        load_model(str(model_copy))
    one_line(err, expected.format(f=model_copy))


def test_a_tokenizer_only_needs_tokenizer_files(model_copy: Path):
    _remove(WEIGHTS, "config.json")(model_copy)
    assert len(load_tokenizer(str(model_copy))) > 1000
    _empty(model_copy)
    with pytest.raises(SpecstopError) as err:
        load_tokenizer(str(model_copy))
    one_line(err, f"{model_copy}: no tokenizer")


# --- the embedded target's cache folder ---------------------------------------------------------

@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[Path], None]]:
    """convert_embedded with a conversion that writes a stand-in weights file; what is
    appended to the returned list runs after it, as another process would meanwhile."""
    meanwhile: list[Callable[[Path], None]] = []

    def save(gguf: Path, folder: Path) -> None:
        (folder / WEIGHTS).write_bytes(b"converted")
        for action in meanwhile:
            action(folder)

    monkeypatch.setattr(load, "embedded_gguf", lambda: Path("model.gguf"))
    monkeypatch.setattr(load, "_save_dequantised", save)
    return meanwhile


@pytest.mark.parametrize("case", ["absent", "empty"])
def test_the_embedded_target_is_moved_into_a_new_or_empty_folder(tmp_path: Path, case: str,
                                                                 fake_conversion):
    cache = tmp_path / "models" / "target"
    if case == "empty":
        cache.mkdir(parents=True)
    assert convert_embedded(cache) == cache
    assert (cache / WEIGHTS).read_bytes() == b"converted"
    assert [p.name for p in cache.parent.iterdir()] == ["target"]  # no temp folder left
    assert convert_embedded(cache) == cache  # converted once


def test_a_cache_folder_holding_other_files_is_refused_and_kept(tmp_path: Path, fake_conversion):
    data = tmp_path / "data"
    (data / "collect").mkdir(parents=True)
    (data / "collect" / "part.parquet").write_bytes(b"hours of decoding")
    with pytest.raises(SpecstopError) as err:
        convert_embedded(data)
    one_line(err, f"{data}: holds other files, not a converted model (no {WEIGHTS}); set "
                  f"models.cache_dir to a new or empty folder")
    assert (data / "collect" / "part.parquet").read_bytes() == b"hours of decoding"
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


@pytest.mark.parametrize("case", ["converted-too", "other-files"])
def test_a_cache_folder_filled_during_the_conversion_is_kept(tmp_path: Path, case: str,
                                                              fake_conversion):
    cache = tmp_path / "target"

    def fill(folder: Path) -> None:  # another process, while this one converts
        cache.mkdir()
        (cache / (WEIGHTS if case == "converted-too" else "notes.txt")).write_bytes(b"theirs")

    fake_conversion.append(fill)
    if case == "converted-too":
        assert convert_embedded(cache) == cache
    else:
        with pytest.raises(SpecstopError) as err:
            convert_embedded(cache)
        one_line(err, f"{cache}: cannot write the converted model")
    assert [p.name for p in cache.iterdir()] == [WEIGHTS if case == "converted-too"
                                                 else "notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no temp folder left


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path: Path, fake_conversion):
    (tmp_path / "target").write_text("a file")
    with pytest.raises(SpecstopError) as err:
        convert_embedded(tmp_path / "target")
    one_line(err, f"{tmp_path / 'target'}: is a file, not a folder (models.cache_dir)")


# --- model names -------------------------------------------------------------------------------

# case -> (name, HF_ENDPOINT or None, what the error says)
NAMES: dict[str, tuple[str, str | None, str]] = {
    "bare-name-offline": ("nope_folder", None, "'nope_folder' is neither a local folder nor a "
                          "cached hub model, and the hub is not reachable (HF_HUB_OFFLINE is set)"),
    "hub-id-unreachable": ("nobody/nothing", "http://127.0.0.1:9",
                           "'nobody/nothing' is neither a local folder nor a cached hub model, "
                           "and the hub is not reachable (no connection to 127.0.0.1:9)"),
    "relative-path": ("./nope", None, "model folder not found: ./nope"),
    "nested-path": ("a/b/c", None, "model folder not found: a/b/c"),
    "weights-file-name": ("nope.safetensors", None, "model folder not found: nope.safetensors"),
    "not-a-hub-id": ("no such model", None, "model folder not found: no such model"),
}


@pytest.mark.parametrize("case", NAMES)
def test_an_unknown_model_name_fails_fast(case: str, monkeypatch: pytest.MonkeyPatch):
    name, endpoint, expected = NAMES[case]
    if endpoint:  # the probe really runs, against a closed local port
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(SpecstopError) as err:
        load_model(name)
    assert time.perf_counter() - start < 5
    one_line(err, expected)


def test_a_file_is_not_a_model_folder(tiny_model_dir: Path):
    with pytest.raises(SpecstopError) as err:
        load_model(str(tiny_model_dir / "config.json"))
    one_line(err, f"{tiny_model_dir / 'config.json'}: not a model folder (a file")


def test_a_cached_hub_id_loads_from_the_cache_offline(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    snapshot = tmp_path / "models--org--name" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_files.hub_kwargs("org/name") == {"local_files_only": True}
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(model_files, "_reachable", lambda address: True)
    assert model_files.hub_kwargs("org/other") == {}  # reachable: transformers asks the hub


# --- draft folders -----------------------------------------------------------------------------

# case -> (specstop_draft.json text, what the error says)
DRAFT_META: dict[str, tuple[str, str]] = {
    "not-json": ("{", "not valid JSON"),
    "not-an-object": ("[]", "not a JSON object"),
    "unknown-family": ('{"family": "big"}', "field 'family' must be one of compact, feature"),
    "compact-without-vocab-ids": ('{"family": "compact"}',
                                  "missing key(s) vocab_ids (needed by a compact draft)"),
    "feature-without-sizes": ('{"family": "feature", "vocab_ids": null}',
                              "missing key(s) target_vocab_size, target_hidden_size"),
    "vocab-ids-not-ids": ('{"family": "compact", "vocab_ids": [1, "a"]}',
                          "key 'vocab_ids' must be null or a non-empty list of token ids"),
    "zero-vocab-size": ('{"family": "feature", "target_vocab_size": 0, '
                        '"target_hidden_size": 32}',
                        "key 'target_vocab_size' must be a positive integer"),
}


@pytest.mark.parametrize("case", DRAFT_META)
def test_bad_draft_metadata_names_the_file_and_key(tmp_path: Path, case: str):
    text, expected = DRAFT_META[case]
    (tmp_path / DRAFT_META_FILE).write_text(text)
    with pytest.raises(SpecstopError) as err:
        read_meta(tmp_path)
    one_line(err, f"{tmp_path / DRAFT_META_FILE}: {expected}")


# case -> (how the saved head is damaged, what the error says; {f} is the folder)
HEADS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated-head": (lambda f: (f / HEAD_WEIGHTS).write_bytes(
        (f / HEAD_WEIGHTS).read_bytes()[:200]), "{f}/head.safetensors: corrupt or truncated"),
    "head-without-vocab-ids": (lambda f: save_file({"fc.weight": torch.zeros(2, 2)},
                                                   f / HEAD_WEIGHTS),
                               "{f}/head.safetensors: no 1-D integer tensor 'vocab_ids'"),
    "head-of-another-shape": (lambda f: save_file(
        {**load_file(f / HEAD_WEIGHTS), "fc.weight": torch.zeros(2, 2)}, f / HEAD_WEIGHTS),
        "{f}/head.safetensors: weights do not match the head's config"),
    "head-weights-missing": (_remove(HEAD_WEIGHTS), "{f}/head.safetensors: draft head weights "
                                                    "missing"),
    "head-without-config": (_remove("config.json"), "{f}: no config.json (the head's config)"),
    "head-config-not-json": (lambda f: (f / "config.json").write_text("{"),
                             "{f}/config.json: not a usable head config"),
}


@pytest.mark.parametrize("case", HEADS)
def test_a_damaged_feature_head_is_named(tmp_path: Path, case: str):
    target = tiny_llama(0)
    folder = tmp_path / "head"
    save_draft(folder, build_feature_head(target, 1, None), "feature", target, None, {})
    damage, expected = HEADS[case]
    damage(folder)
    with pytest.raises(SpecstopError) as err:
        load_feature_head(folder, target, read_meta(folder))
    one_line(err, expected.format(f=folder))


def test_compact_vocab_ids_beyond_the_vocabulary_are_refused(tiny_model_dir: Path,
                                                              model_copy: Path):
    (model_copy / DRAFT_META_FILE).write_text(json.dumps({"family": "compact",
                                                    "vocab_ids": [0, 10 ** 6]}))
    with pytest.raises(SpecstopError) as err:
        load_runtime(str(tiny_model_dir), str(model_copy), "float32", "cpu")
    one_line(err, f"{model_copy / DRAFT_META_FILE}: vocab_ids name token 1000000, beyond the "
                  f"draft's vocabulary of 49152")


# --- context limits ----------------------------------------------------------------------------

def _feature_head(target: Path, folder: Path, context: int) -> Path:
    """A feature head on `target` saved with `context` positions in its config."""
    model = load_model(str(target)).model
    save_draft(folder, build_feature_head(model, 1, None), "feature", model, None, {})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return folder


@pytest.mark.parametrize("case", ["short-draft", "short-target", "layers", "feature-head"])
def test_the_context_limit_is_the_smaller_models(tiny_model_dir: Path, tiny_target: Path,
                                                 tmp_path: Path, case: str):
    """tiny_model_dir has 96 positions, tiny_target 512."""
    target, draft, expected = {
        "short-draft": (tiny_target, str(tiny_model_dir), (TINY_CONTEXT, "draft")),
        "short-target": (tiny_model_dir, str(tiny_target), (TINY_CONTEXT, "target")),
        "layers": (tiny_target, "layers:1", (512, "target")),
        "feature-head": (tiny_target, str(_feature_head(tiny_target, tmp_path / "head", 64)),
                         (64, "draft")),
    }[case]
    runtime = load_runtime(str(target), draft, "float32", "cpu")
    assert (runtime.context_limit, runtime.limited_by) == expected


def test_a_prompt_over_the_drafts_context_names_the_draft(tiny_model_dir: Path,
                                                          tiny_target: Path):
    runtime = load_runtime(str(tiny_target), str(tiny_model_dir), "float32", "cpu")
    prompt = torch.zeros(TINY_CONTEXT, dtype=torch.long)
    with pytest.raises(SpecstopError) as err:
        runtime.check_fits(prompt, DecodeConfig(max_new_tokens=8, max_depth=4))
    one_line(err, f"= {TINY_CONTEXT + 13} tokens exceeds the model's context of {TINY_CONTEXT} "
                  f"tokens (the draft's max_position_embeddings)")
    runtime.check_fits(prompt[:TINY_CONTEXT - 13], DecodeConfig(max_new_tokens=8, max_depth=4))


# --- stop models -------------------------------------------------------------------------------

class OutOfRange(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1) + 2.0


class NotFinite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] * float("nan")


F = len(FEATURES)
# case -> (the module, what the error says)
STOP_MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "too-few-inputs": (lambda: nn.Linear(5, 1),
                       f"the model does not accept [N, {F}] features (RuntimeError: mat1 and "
                       "mat2 shapes cannot be multiplied"),
    "two-outputs-per-row": (lambda: nn.Linear(F, 2),
                            "the model returns [3, 2] for 3 rows, not one probability per row"),
    "a-column": (lambda: nn.Linear(F, 1), "the model returns [3, 1] for 3 rows"),
    # the probe's rows are 0, 0.5, 1 in every column but depth (1, 2, 3): sums + 2
    "out-of-range": (OutOfRange, f"the model returns [3.0, {0.5 * (F - 1) + 4.0}, {F + 4.0}] "
                                 "for 3 rows, not probabilities in [0, 1]"),
    "not-finite": (NotFinite, "the model returns [nan, nan, nan] for 3 rows, not probabilities"),
}


@pytest.mark.parametrize("case", STOP_MODELS)
def test_a_stop_model_of_the_wrong_shape_is_refused(tmp_path: Path, case: str):
    build, expected = STOP_MODELS[case]
    path = write_stop_model(tmp_path / "stop.pt", torch.jit.script(build().eval()))
    with pytest.raises(SpecstopError) as err:
        load_stop_model(path)
    one_line(err, f"{path}: {expected}")


def test_a_well_formed_stop_model_loads(tmp_path: Path):
    assert load_stop_model(write_stop_model(tmp_path / "stop.pt")).rule == "threshold"


# --- cost tables -------------------------------------------------------------------------------

COSTS = {"tree_sizes": [1, 4, 7], "target": {"seconds": {"1": 0.04, "4": 0.05, "7": 0.06}},
         "draft": {"seconds": {"1": 0.002, "3": 0.003}}, "decision_seconds": 1e-5}


def _costs(**changes: object) -> dict:
    raw = json.loads(json.dumps(COSTS))
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = raw
        for parent in parents:
            node = node[parent]
        if value is None:
            del node[key]
        else:
            node[key] = value
    return raw


# case -> (costs.json content, what the error says after "costs.json: not a cost model (")
COST_MODELS: dict[str, tuple[dict, str]] = {
    "empty-target": (_costs(target__seconds={}), "field 'target.seconds' must map widths"),
    "zero-time": (_costs(target__seconds={"1": 0.0}), "field 'target.seconds': width 1 took 0.0"),
    "negative-draft": (_costs(draft__seconds={"1": 0.002, "3": -1}),
                       "field 'draft.seconds': width 3 took -1.0"),
    "infinite-time": (_costs(draft__seconds={"1": float("inf")}),
                      "field 'draft.seconds': width 1 took inf"),
    "nan-time": (_costs(target__seconds={"1": float("nan")}),
                 "field 'target.seconds': width 1 took nan s, not a finite time > 0"),
    "no-width-1": (_costs(target__seconds={"4": 0.05}),
                   "field 'target.seconds' has no width 1"),
    "bad-width": (_costs(draft__seconds={"x": 0.1}), "field 'draft.seconds': invalid literal"),
    "no-draft": (_costs(draft=None), "missing field 'draft'"),
    "empty-tree": (_costs(tree_sizes=[]), "field 'tree_sizes' must be an increasing list"),
    "negative-decision": (_costs(decision_seconds=-1), "field 'decision_seconds' must be finite"),
}


@pytest.mark.parametrize("case", COST_MODELS)
def test_a_bad_cost_model_names_the_field(tmp_path: Path, case: str):
    raw, expected = COST_MODELS[case]
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError) as err:
        CostModel.load(path)
    one_line(err, f"{path}: not a cost model ({expected}")


def test_a_good_cost_model_loads(tmp_path: Path):
    (tmp_path / "costs.json").write_text(json.dumps(COSTS))
    assert CostModel.load(tmp_path / "costs.json").target_step == 0.04


VERIFY = {"model": "m", "dtype": "float32", "device": "cpu", "context": 200,
          "seconds": {"1": 0.01, "2": 0.012}}
# case -> (verify.json text or None for no file, what the error says)
VERIFY_TABLES: dict[str, tuple[str | None, str]] = {
    "missing": (None, "cannot read the verify costs (No such file or directory)"),
    "not-json": ("{", "not a verify-cost table (Expecting"),
    "no-seconds": (json.dumps({**VERIFY, "seconds": None}),
                   "not a verify-cost table (field 'seconds' must map widths to seconds"),
    "empty-seconds": (json.dumps({**VERIFY, "seconds": {}}),
                      "not a verify-cost table (field 'seconds' must map widths to seconds"),
    "no-width-1": (json.dumps({**VERIFY, "seconds": {"2": 0.01}}),
                   "not a verify-cost table (field 'seconds' has no width 1"),
    "zero-time": (json.dumps({**VERIFY, "seconds": {"1": 0}}),
                  "not a verify-cost table (field 'seconds': width 1 took 0.0 s, not a finite"),
    "zero-width": (json.dumps({**VERIFY, "seconds": {"1": 0.01, "0": 0.01}}),
                   "not a verify-cost table (field 'seconds': width 0 is below 1"),
    "missing-field": (json.dumps({k: v for k, v in VERIFY.items() if k != "seconds"}),
                      "not a verify-cost table (missing field 'seconds')"),
}


@pytest.mark.parametrize("case", VERIFY_TABLES)
def test_a_bad_verify_cost_table_names_the_file(tmp_path: Path, case: str):
    text, expected = VERIFY_TABLES[case]
    path = tmp_path / "verify.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SpecstopError) as err:
        VerifyCosts.load(path)
    one_line(err, f"{path}: {expected}")


def test_a_verify_cost_table_round_trips(tmp_path: Path):
    table = VerifyCosts("m", "float32", "cpu", 200, {1: 0.01, 2: 0.012})
    table.save(tmp_path / "verify.json")
    assert VerifyCosts.load(tmp_path / "verify.json") == table


# --- workspaces and prompts --------------------------------------------------------------------

@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A one-file git project with a params.yaml."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "params.yaml").write_text("bench:\n  prompts: 1\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


@pytest.mark.parametrize("case", ["a-file", "under-a-file"])
def test_a_workspace_destination_that_cannot_be_a_folder_is_named(project: Path, tmp_path: Path,
                                                                   case: str):
    (tmp_path / "taken").write_text("a file")
    dest = tmp_path / "taken" if case == "a-file" else tmp_path / "taken" / "ws"
    expected = {"a-file": f"{dest}: exists and is not a folder",
                "under-a-file": f"{dest}: cannot create the workspace folder (Not a directory)"}
    with pytest.raises(SpecstopError) as err:
        make_workspace(project, dest, None, {})
    one_line(err, expected[case])


@pytest.mark.parametrize("text, expected", [
    (b"caf\xc3\xa9 \xff!".decode("utf-8", "surrogateescape"), "byte 0xff at position 6"),
    ("a\ud800", "U+D800 at position 1"),
])
def test_a_prompt_that_is_not_utf8_is_refused(text: str, expected: str):
    with pytest.raises(SpecstopError) as err:
        check_utf8(text)
    one_line(err, f"the prompt is not valid UTF-8 ({expected})")
