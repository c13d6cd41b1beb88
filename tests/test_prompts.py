"""Stage `prompts`: sources with bad rows, de-duplication, splits, ids, errors, atomic writes,
the chat template, and `specstop prompts` end to end.  Every source file is made here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from specstop.common.errors import SpecstopError
from specstop.decoder.load import chat_text
from specstop.prompts import splits as prompt_splits
from specstop.prompts.sources import (SourceRequests, parse_source, parse_sources,
                                              read_source)
from specstop.prompts.splits import (SPLITS, check_fractions, prompt_id, split_prompts,
                                             write_split)

FRACTIONS = {"draft": 0.5, "train": 0.2, "val": 0.15, "test": 0.15}
GOOD = [{"q": "What is 2 + 2?"}, {"q": "Name a prime."}, {"q": "  What is 2 +  2?\n"}]
BAD = [{"other": "x"}, {"q": 7}, {"q": "   "}, {"q": None}]  # missing, non-string, empty, null
BAD_REASONS = {"missing field 'q'": 2, "non-string field 'q'": 1, "empty field 'q'": 1}


def write_records(path: Path, records: list) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(records))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def source(raw: dict) -> SourceRequests:
    return read_source(parse_source(raw, 0))


def requests_source(name: str, requests: list[str], cap: int | None = None) -> SourceRequests:
    spec = parse_source({"path": f"{name}.json", "field": "q", "max_prompts": cap}, 0)
    return SourceRequests(spec, len(requests), list(requests))


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_local_file_bad_rows_are_counted(tmp_path: Path, suffix: str):
    bad, reasons = BAD, BAD_REASONS
    if suffix == ".parquet":  # one type per column: a non-string column is tested below
        bad = [r for r in BAD if not isinstance(r.get("q"), int)]
        reasons = {k: v for k, v in BAD_REASONS.items() if not k.startswith("non-string")}
    path = write_records(tmp_path / f"qs{suffix}", GOOD + bad)
    read = source({"path": str(path), "field": "q"})
    assert read.spec.name == "qs"
    assert read.requests == [r["q"] for r in GOOD]  # verbatim; duplicates go later
    assert read.rows == len(GOOD) + len(bad)
    assert dict(read.skipped) == reasons


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_byte_order_mark_keeps_the_first_row(tmp_path: Path, suffix: str):
    path = write_records(tmp_path / f"qs{suffix}", GOOD)
    path.write_text(path.read_text(), encoding="utf-8-sig")  # as Windows editors save it
    read = source({"path": str(path), "field": "q"})
    assert read.requests == [r["q"] for r in GOOD] and not read.skipped


def test_json_non_objects_and_jsonl_bad_lines_are_counted(tmp_path: Path):
    json_file = write_records(tmp_path / "a.json", [*GOOD, "just a string", [1]])
    assert source({"path": str(json_file), "field": "q"}).skipped == {"not an object": 2}
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"q": "fine"}\n{not json\n\n{"q": "also fine"}\n')
    read = source({"path": str(jsonl), "field": "q"})
    assert (read.requests, read.rows, read.skipped) == (["fine", "also fine"], 3,
                                                        {"invalid JSON line": 1})


def test_template_builds_requests_from_several_fields(tmp_path: Path):
    path = write_records(tmp_path / "piqa.json", [
        {"goal": "Open a jar", "correct_answer": "Twist the lid"},
        {"goal": "Boil water"},  # no answer: skipped
    ])
    read = source({"path": str(path), "template": "Goal: {goal}\nHow? {correct_answer}"})
    assert read.requests == ["Goal: Open a jar\nHow? Twist the lid"]
    assert read.skipped == {"missing field 'correct_answer'": 1}


def test_dataset_source_through_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    path = write_records(tmp_path / "qs.jsonl", GOOD + [{"q": 7}])
    read = source({"dataset": "json", "data_files": str(path), "field": "q", "name": "local"})
    assert read.requests == [r["q"] for r in GOOD]
    assert read.skipped == {"non-string field 'q'": 1}


def test_humaneval_is_the_embedded_default():
    from specstop.evaluation.side_by_side import humaneval_problems, humaneval_request

    read = source({"embedded": "humaneval"})
    assert read.rows == len(read.requests) == 164
    assert read.requests[:2] == [humaneval_request(p) for p in humaneval_problems(2)]


def test_duplicates_are_counted_and_kept_by_the_first_source():
    a = requests_source("a", ["Hello world", "Hello   world\n", "Other"])
    b = requests_source("b", ["hello world", " Hello world", "New"])  # case differs: kept
    prompts = split_prompts([a, b], FRACTIONS, seed=0)
    assert a.skipped == {"duplicate": 1} and b.skipped == {"duplicate": 1}
    assert sorted((p.source, p.request) for p in prompts) == [
        ("a", "Hello world"), ("a", "Other"), ("b", "New"), ("b", "hello world")]
    assert len({p.prompt_id for p in prompts}) == len(prompts)


def split_of(requests: list[str], seed: int, **kwargs) -> dict[str, str]:
    return {p.request: p.split
            for p in split_prompts([requests_source("s", requests, **kwargs)], FRACTIONS, seed)}


def test_splits_are_disjoint_sized_and_seeded():
    requests = [f"question {i}" for i in range(200)]
    first = split_of(requests, seed=0)
    assert len(first) == 200  # each prompt in exactly one split
    assert Counter(first.values()) == {"draft": 100, "train": 40, "val": 30, "test": 30}
    assert split_of(list(reversed(requests)), seed=0) == first  # file order does not matter
    assert split_of(requests, seed=1) != first


def test_interleave_takes_each_source_in_turn_so_every_prefix_mixes_them():
    sources = ["code", "code", "code", "code", "chat", "chat", "math"]
    order = prompt_splits.interleave(sources)
    assert order == [0, 4, 6, 1, 5, 2, 3]
    assert [sources[i] for i in order[:3]] == ["code", "chat", "math"]
    assert prompt_splits.interleave([]) == []


def test_cap_keeps_a_seeded_sample():
    requests = [f"question {i}" for i in range(50)]
    source_ = requests_source("s", requests, cap=10)
    prompts = split_prompts([source_], FRACTIONS, seed=0)
    assert len(prompts) == 10 and source_.skipped == {"over max_prompts": 40}
    assert Counter(p.split for p in prompts) == {"draft": 5, "train": 2, "val": 2, "test": 1}
    assert {p.request for p in prompts} != set(requests[:10])


def test_ids_and_splits_do_not_move_when_a_source_is_added():
    assert prompt_id("What is 2 + 2?") == prompt_id("  What is 2 +\n2? ") == "38d46ad3618826cf"
    a = [f"question {i}" for i in range(40)]
    alone = split_prompts([requests_source("a", a)], FRACTIONS, seed=0)
    more = split_prompts([requests_source("a", a), requests_source("b", ["x", "y", "z"])],
                         FRACTIONS, seed=0)
    assert [p for p in more if p.source == "a"] == alone


@pytest.mark.parametrize("case", ["missing-file", "missing-field", "not-a-list", "bad-json",
                                  "not-parquet", "int-column", "unsupported-type",
                                  "missing-dataset-file"])
def test_unusable_source_is_one_line_naming_file_and_field(tmp_path: Path, case: str):
    raw = {"path": str(tmp_path / "qs.json"), "field": "q"}
    expected = "no usable rows (2 missing field 'q')"
    if case == "missing-file":
        raw["path"], expected = str(tmp_path / "absent.jsonl"), "not found"
    elif case == "missing-field":
        write_records(tmp_path / "qs.json", [{"question": "a"}, {"question": "b"}])
    elif case == "not-a-list":
        (tmp_path / "qs.json").write_text('{"q": "a"}')
        expected = "expected a JSON list of records"
    elif case == "bad-json":
        (tmp_path / "qs.json").write_text("[{")
        expected = "cannot read ("
    elif case == "not-parquet":
        raw["path"] = str(tmp_path / "qs.parquet")
        (tmp_path / "qs.parquet").write_text("not parquet")
        expected = "cannot read ("
    elif case == "int-column":
        raw["path"] = str(write_records(tmp_path / "qs.parquet", [{"q": 1}, {"q": 2}]))
        expected = "no usable rows (2 non-string field 'q')"
    elif case == "unsupported-type":
        raw["path"], expected = str(tmp_path / "qs.csv"), "unsupported file type '.csv'"
    else:
        raw = {"dataset": "json", "data_files": str(tmp_path / "absent.jsonl"), "field": "q"}
        expected = "cannot load ("
    with pytest.raises(SpecstopError) as err:
        source(raw)
    message = str(err.value)
    assert "\n" not in message and expected in message
    assert "absent.jsonl" in message or "qs." in message
    assert "field 'q'" in message


@pytest.mark.parametrize("raw, expected", [
    ([{"path": "a.json"}], "give either field"),
    ([{"path": "a.json", "field": "q", "template": "{q}"}], "give either field"),
    ([{"path": "a.json", "feild": "q"}], "unknown key 'feild'"),
    ([{"path": "a.json", "dataset": "x", "field": "q"}], "exactly one of"),
    ([{"embedded": "mbpp"}], "embedded sources are humaneval"),
    ([{"path": "a.json", "template": "no fields"}], "must name fields"),
    ([{"path": "a.json", "field": "q", "max_prompts": 0}], "max_prompts"),
    ([{"path": "a/x.json", "field": "q"}, {"path": "b/x.json", "field": "q"}], "named 'x'"),
    ([], "non-empty list"),
])
def test_bad_source_params(raw: list, expected: str):
    with pytest.raises(SpecstopError, match=expected):
        parse_sources(raw)


@pytest.mark.parametrize("fractions", [{"train": 0.5, "val": 0.2, "test": 0.2},
                                       {"train": 1.2, "val": -0.2, "test": 0.0},
                                       {"train": 0.7, "val": 0.3}])
def test_bad_fractions(fractions: dict):
    with pytest.raises(SpecstopError, match="prompts.fractions"):
        check_fractions(fractions)


def rows(n: int) -> list[dict[str, str]]:
    return [{"prompt_id": str(i), "source": "s", "request": f"r{i}", "text": f"t{i}",
             "split": "train"} for i in range(n)]


def test_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "train.parquet"
    write_split(rows(3), path)

    def half_then_fail(table: pa.Table, where: Path) -> None:
        Path(where).write_bytes(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(prompt_splits.pq, "write_table", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_split(rows(5), path)
    assert pq.read_table(path).to_pylist() == rows(3)
    assert [p.name for p in tmp_path.iterdir()] == ["train.parquet"]


def test_text_is_the_chat_rendering_of_the_request(embedded_dir: Path):
    """`collect` tokenizes `text` without special tokens: the same ids as the chat template."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    for request in ["What is 2 + 2?", "def f(x):\n    return x\n", "  spaces  "]:
        text = chat_text(tokenizer, request)
        assert request in text
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(
            tokenizer.apply_chat_template([{"role": "user", "content": request}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False))


def run_cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specstop.pipeline.cli", *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_held_out_source_goes_whole_to_the_heldout_split():
    """A `held_out` source is none of the learners' (draft, train, val, test): all of its
    prompts, capped, are in `heldout`; a duplicate of an earlier source stays with it."""
    kept = requests_source("main", [f"Question {i}?" for i in range(20)])
    spec = parse_source({"path": "other.json", "field": "q", "held_out": True,
                         "max_prompts": 4}, 1)
    other = SourceRequests(spec, 7, ["Question 3?"] + [f"Task {i}." for i in range(6)])
    prompts = split_prompts([kept, other], FRACTIONS, seed=0)
    held = [p for p in prompts if p.split == prompt_splits.HELD_OUT]
    assert len(held) == 4 and {p.source for p in held} == {"other"}
    assert {p.split for p in prompts if p.source == "main"} <= set(SPLITS)
    assert other.skipped == {"duplicate": 1, "over max_prompts": 2}
    summary = prompt_splits.summarise([kept, other], prompts, 0, FRACTIONS)
    assert summary["sources"]["other"]["splits"] == {"heldout": 4}
    assert summary["splits"]["heldout"] == 4 and sum(summary["splits"].values()) == 24
    with pytest.raises(SpecstopError, match=r"prompts.sources\[0\]: held_out must be true or "):
        parse_source({"path": "x.json", "field": "q", "held_out": "yes"}, 0)


def test_a_draft_only_source_goes_whole_to_the_draft_split():
    """A `draft_only` source adds to the draft's prompts alone, and the other sources' splits do
    not move; with `held_out` too it is a one-line error."""
    kept = requests_source("main", [f"Question {i}?" for i in range(20)])
    alone = split_prompts([kept], FRACTIONS, seed=0)
    spec = parse_source({"path": "more.json", "field": "q", "draft_only": True}, 1)
    more = SourceRequests(spec, 6, ["Question 3?"] + [f"Task {i}." for i in range(5)])
    prompts = split_prompts([kept, more], FRACTIONS, seed=0)
    assert prompts[:len(alone)] == alone
    assert {(p.source, p.split) for p in prompts[len(alone):]} == {("more", "draft")}
    summary = prompt_splits.summarise([kept, more], prompts, 0, FRACTIONS)
    assert summary["sources"]["more"]["splits"] == {"draft": 5}
    assert summary["splits"]["draft"] == 10 + 5 and summary["splits"]["heldout"] == 0
    with pytest.raises(SpecstopError, match=r"prompts.sources\[2\]: give held_out or "
                                            "draft_only, not both"):
        parse_source({"path": "x.json", "field": "q", "held_out": True, "draft_only": True}, 2)
    with pytest.raises(SpecstopError, match=r"prompts.sources\[0\]: draft_only must be true"):
        parse_source({"path": "x.json", "field": "q", "draft_only": 1}, 0)


def test_cli_prompts_end_to_end(tmp_path: Path, embedded_dir: Path):
    write_records(tmp_path / "local.jsonl", [{"q": f"Local question {i}?"} for i in range(20)]
                  + [{"q": ""}, {"q": "Local question 0?"}])
    params = {"models": {"target": "embedded", "cache_dir": str(embedded_dir)},
              "prompts": {"out": "out/prompts", "seed": 3, "fractions": FRACTIONS, "sources": [
                  {"path": "local.jsonl", "field": "q"}, {"embedded": "humaneval"}]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    result = run_cli(["prompts"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("local: 22 rows -> 20 prompts (draft 10, train 4, val 3, test 3); "
                        "skipped 2: 1 duplicate, 1 empty field 'q'")
    assert lines[1].startswith("humaneval: 164 rows -> 164 prompts")
    assert lines[-1].startswith("184 prompts (draft 92, train 37, ")
    out = tmp_path / "out" / "prompts"
    tables = {split: pq.read_table(out / f"{split}.parquet").to_pylist() for split in SPLITS}
    assert all({"prompt_id", "source", "request", "text", "split"} <= set(rows_[0])
               for rows_ in tables.values())
    ids = [row["prompt_id"] for rows_ in tables.values() for row in rows_]
    assert len(ids) == len(set(ids)) == 184
    assert all(row["split"] == split for split, rows_ in tables.items() for row in rows_)
    assert all(row["text"].endswith("<|im_start|>assistant\n") and row["request"] in row["text"]
               for rows_ in tables.values() for row in rows_)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sources"]["local"]["skipped"] == {"duplicate": 1, "empty field 'q'": 1}
    assert summary["sources"]["humaneval"]["prompts"] == 164
    assert sum(summary["splits"].values()) == 184
    assert sorted(p.name for p in out.iterdir()) == ["draft.parquet", "heldout.parquet",
                                                     "summary.json", "test.parquet",
                                                     "train.parquet", "val.parquet"]
    assert pq.read_table(out / "heldout.parquet").num_rows == 0  # no held-out source

    params["prompts"]["sources"][0]["path"] = "absent.jsonl"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    failed = run_cli(["prompts"], tmp_path)
    assert failed.returncode == 2 and failed.stderr.splitlines() == [
        "specstop: error: file 'absent.jsonl' (field 'q'): not found"]
