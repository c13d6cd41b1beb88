"""The `embedded: magpie` source: requests the target writes from its chat template's user-turn
prefix.  The filters and the cache on a fake sampler; the real sampler on a tiny random Llama
(seeded) and on the embedded target (integration); its config errors; the stage's wiring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from specstop.common.errors import SpecstopError
from specstop.common.params import ModelsConfig, PromptsConfig, apply_profile
from specstop.decoder.load import end_of_turn_ids, user_turn_prefix
from specstop.pipeline.params import checked_params, read_params_file
from specstop.pipeline.prompts import target_writer
from specstop.prompts.build import build_prompts
from specstop.prompts.self_written import (Writer, batch_seed, cache_path, read_self_written,
                                           write_requests)
from specstop.prompts.sources import Sampling, parse_source, parse_sources
from specstop.prompts.splits import SPLITS

from conftest import ROOT

END = "<|im_end|>"
ENDS = (END, "<|endoftext|>")
FIRST_BATCH = [  # what a fake sampler returns, and the filter each sample meets
    f"{END}",                                                          # empty
    f"   \n {END}{END}",                                               # empty
    f"What is the capital of France?{END}{END}",                       # kept
    "Tell me a joke about cats and dogs",                              # truncated
    f"the cat sat the cat sat the cat sat the cat sat on the mat{END}",  # repeated 3-gram
    f"  What is the capital of   France?\n{END}",                      # duplicate
    f"Hi there{END}",                                                  # too few words
    f"1234 5678 + 999 = ?{END}",                                       # mostly non-letters
    f"buy buy sell sell hold hold buy sell hold buy sell hold{END}",   # few distinct words
    "How do I bake bread at home?<|endoftext|>",                       # kept (the eos)
    f" Explain photosynthesis in simple words.{END}<|im_start|>user",  # kept, cut at the end
]
SECOND_BATCH = [f"Name three rivers in Europe.{END}"] + [f"Unread sample number {i}.{END}"
                                                         for i in range(len(FIRST_BATCH) - 1)]
KEPT = ["What is the capital of France?", "How do I bake bread at home?",
        "Explain photosynthesis in simple words.", "Name three rivers in Europe."]
SKIPPED = {"empty": 2, "truncated": 1, "repeated 3-gram": 1, "duplicate": 1, "too few words": 1,
           "mostly non-letters": 1, "few distinct words": 1}


class FakeSampler:
    """Returns the given batches in turn (then truncated samples); records (n, seed)."""

    def __init__(self, *batches: list[str]):
        self.batches, self.calls = list(batches), []

    def __call__(self, n: int, seed: int) -> list[str]:
        self.calls.append((n, seed))
        return self.batches.pop(0) if self.batches else ["no end in sight"] * n


def test_filters_skip_and_count_every_reason():
    sample = FakeSampler(FIRST_BATCH, SECOND_BATCH)
    written = write_requests(sample, ENDS, count=4, batch_size=len(FIRST_BATCH), seed=7,
                             name="magpie")
    assert written.requests == KEPT
    assert dict(written.skipped) == SKIPPED
    assert written.rows == len(FIRST_BATCH) + 1  # stops at the 4th request: the rest unread
    assert sample.calls == [(11, batch_seed(7, "magpie", 0)), (11, batch_seed(7, "magpie", 1))]
    assert len({batch_seed(s, "magpie", b) for s in (0, 1) for b in range(50)}) == 100


def magpie(**raw) -> object:
    return parse_source({"embedded": "magpie", **raw}, 0)


class FakeWriter:
    """A `Writer` over fake samplers; counts how often the model would be loaded."""

    def __init__(self, *batches: list[str], dtype: str = "float32"):
        self.batches, self.loads = batches, []
        self.writer = Writer({"model": "fake", "dtype": dtype, "device": "cpu"}, self.load)

    def load(self, sampling: Sampling):
        self.loads.append(sampling)
        return FakeSampler(*self.batches), ENDS


def test_budget_spent_without_a_request_is_one_line_naming_the_source(tmp_path: Path):
    fake = FakeWriter()  # every sample truncated
    spec = magpie(max_prompts=2, batch_size=3)
    with pytest.raises(SpecstopError) as err:
        read_self_written(spec, tmp_path, 0, fake.writer)
    assert str(err.value) == ("embedded set 'magpie': no usable request in 9 samples "
                              "(9 truncated); raise max_new_tokens or try another target")


def test_a_short_source_keeps_what_it_found(tmp_path: Path, capsys: pytest.CaptureFixture):
    fake = FakeWriter(FIRST_BATCH)
    read = read_self_written(magpie(max_prompts=4, batch_size=11), tmp_path, 0, fake.writer)
    assert read.requests == KEPT[:3] and read.rows == 22  # 2 batches: 4 samples a request
    assert read.skipped == {**SKIPPED, "truncated": 1 + 11}
    assert "magpie: 3 of 4 requests within 22 samples" in capsys.readouterr().err


def test_cache_is_reused_while_the_settings_match(tmp_path: Path):
    fake = FakeWriter(FIRST_BATCH, SECOND_BATCH)
    spec = magpie(max_prompts=4, batch_size=11)
    first = read_self_written(spec, tmp_path, 3, fake.writer)
    cached = json.loads(cache_path(tmp_path, "magpie").read_text())
    assert cached["settings"] == {"seed": 3, "count": 4, "model": "fake", "dtype": "float32",
                                  "device": "cpu", "max_new_tokens": 64, "temperature": 1.0,
                                  "top_p": 0.95, "batch_size": 11}
    assert cached["requests"] == KEPT and cached["rows"] == 12 and cached["skipped"] == SKIPPED
    again = read_self_written(spec, tmp_path, 3, fake.writer)
    assert len(fake.loads) == 1  # not sampled again
    assert (again.requests, again.rows, again.skipped) == (first.requests, 12, SKIPPED)

    read_self_written(magpie(max_prompts=4, batch_size=11, temperature=0.7), tmp_path, 3,
                      fake.writer)
    assert len(fake.loads) == 2 and fake.loads[1].temperature == 0.7
    read_self_written(spec, tmp_path, 4, fake.writer)  # another seed
    other_dtype = FakeWriter(FIRST_BATCH, SECOND_BATCH, dtype="bfloat16")
    read_self_written(spec, tmp_path, 4, other_dtype.writer)
    assert len(fake.loads) == 3 and len(other_dtype.loads) == 1
    cache_path(tmp_path, "magpie").write_text("{not json")
    assert read_self_written(spec, tmp_path, 4, other_dtype.writer).requests == KEPT
    assert len(other_dtype.loads) == 2


def test_stage_writes_magpie_prompts_beside_humaneval(tmp_path: Path):
    config = PromptsConfig(out=tmp_path / "prompts", sources=[
        {"embedded": "humaneval", "max_prompts": 10},
        {"embedded": "magpie", "max_prompts": 4, "batch_size": 11}])
    fake = FakeWriter(FIRST_BATCH, SECOND_BATCH)
    build_prompts(config, lambda request: f"<{request}>", fake.writer)
    rows = [row for split in SPLITS
            for row in pq.read_table(config.out / f"{split}.parquet").to_pylist()]
    assert sorted(r["request"] for r in rows if r["source"] == "magpie") == sorted(KEPT)
    assert sum(r["source"] == "humaneval" for r in rows) == 10 and len(rows) == 14
    summary = json.loads((config.out / "summary.json").read_text())["sources"]["magpie"]
    assert (summary["rows"], summary["prompts"], summary["skipped"]) == (12, 4, SKIPPED)
    assert cache_path(config.out, "magpie").is_file()
    with pytest.raises(SpecstopError, match="magpie'.*needs the target"):
        build_prompts(config, str)


@pytest.mark.parametrize("raw, expected", [
    ({"max_prompts": 0}, "prompts.sources[0]: max_prompts must be a positive integer or null"),
    ({"max_prompts": "300"}, "prompts.sources[0]: max_prompts must be a positive integer"),
    ({"max_new_tokens": 0}, "prompts.sources[0]: max_new_tokens must be an integer in [1, 1024], "
                            "got 0"),
    ({"temperature": 0}, "prompts.sources[0]: temperature must be a number in [0.001, 100], got 0"),
    ({"top_p": 1.5}, "prompts.sources[0]: top_p must be a number in (0, 1], got 1.5"),
    ({"batch_size": True}, "prompts.sources[0]: batch_size must be a positive integer, got True"),
    ({"field": "q"}, "prompts.sources[0]: embedded sources are humaneval, magpie"),
])
def test_bad_magpie_settings_are_one_line_naming_the_key(raw: dict, expected: str):
    with pytest.raises(SpecstopError) as err:
        parse_sources([{"embedded": "magpie", **raw}])
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_sampling_keys_belong_to_magpie_only_and_defaults_apply():
    with pytest.raises(SpecstopError, match=r"sources\[0\]: temperature is a key of "
                                            r"`embedded: magpie` only"):
        parse_sources([{"path": "a.json", "field": "q", "temperature": 1.0}])
    assert magpie().max_prompts == magpie(max_prompts=None).max_prompts == 200
    assert magpie().sampling == Sampling(64, 1.0, 0.95, 16)
    assert magpie(temperature=1, top_p=1, name="chat").sampling.top_p == 1.0
    assert parse_source({"embedded": "humaneval"}, 0).sampling is None
    assert [s.name for s in parse_sources(PromptsConfig().sources)] == ["humaneval", "magpie"]


def test_user_turn_prefix_is_the_template_up_to_the_user_message(embedded_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    assert user_turn_prefix(tokenizer) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\n")
    assert end_of_turn_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(END)]
    tokenizer.chat_template = None
    with pytest.raises(SpecstopError, match="no chat template"):
        user_turn_prefix(tokenizer)


def test_real_sampler_is_seeded(tiny_model_dir: Path):
    models = ModelsConfig(target=str(tiny_model_dir), dtype="float32", device="cpu")
    writer = target_writer(models)
    assert writer.identity == {"model": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}
    sample, ends = writer.load(Sampling(max_new_tokens=6, batch_size=3))
    assert ends == (END,)
    first = sample(3, 11)
    assert len(first) == 3 and len(set(first)) == 3 and all(first)
    assert sample(3, 11) == first
    assert sample(3, 12) != first


@pytest.mark.integration
def test_embedded_target_writes_the_same_requests_for_a_seed(embedded_dir: Path):
    writer = target_writer(ModelsConfig(target="embedded", cache_dir=embedded_dir,
                                        dtype="float32", device="cpu"))
    sample, ends = writer.load(Sampling(max_new_tokens=40, batch_size=4))
    runs = [write_requests(sample, ends, 2, 4, seed, "magpie").requests for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and len(runs[0]) == 2 and runs[2] != runs[0]
    assert all(len(r.split()) >= 3 and "<|" not in r for r in runs[0] + runs[2])


def test_stage_cli_loads_the_target_for_magpie(tmp_path: Path, tiny_target: Path):
    """A random target never ends a user turn: every sample is truncated, a one-line error."""
    params = {"models": {"target": str(tiny_target), "dtype": "float32", "device": "cpu"},
              "prompts": {"out": "out", "sources": [
                  {"embedded": "magpie", "max_prompts": 1, "batch_size": 4,
                   "max_new_tokens": 3}]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    result = subprocess.run([sys.executable, "-m", "specstop.pipeline.cli", "prompts"],
                            cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "specstop: error: embedded set 'magpie': no usable request in 4 samples (4 truncated); "
        "raise max_new_tokens or try another target")
    cached = json.loads(cache_path(tmp_path / "out", "magpie").read_text())
    assert cached["settings"]["model"] == str(tiny_target) and cached["requests"] == []


def test_params_files_check_magpie_sources_and_the_profiles_parse():
    with pytest.raises(SpecstopError) as err:
        checked_params({"prompts": {"sources": [{"embedded": "humaneval"},
                                                {"embedded": "magpie", "max_prompts": -1}]}})
    assert str(err.value) == ("params.yaml: prompts.sources[1]: max_prompts must be a positive "
                              "integer or null")
    raw = read_params_file(ROOT / "params.yaml")
    default = parse_sources(raw["prompts"]["sources"])
    assert [(s.name, s.max_prompts, s.held_out, s.draft_only) for s in default] == \
        [("humaneval", None, False, False), ("magpie", 160, False, False),
         ("magpie-draft", 160, False, True), ("tasks", None, True, False)]
    smoke = parse_sources(apply_profile(raw, "smoke")["prompts"]["sources"])
    assert [(s.name, s.max_prompts, s.held_out, s.draft_only) for s in smoke] == \
        [("humaneval", 40, False, False), ("magpie", 12, False, False),
         ("magpie-draft", 6, False, True), ("tasks", 3, True, False)]
    assert smoke[1].sampling.max_new_tokens == 48
