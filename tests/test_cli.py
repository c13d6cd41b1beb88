"""The `specstop` command end to end, in subprocesses, on tiny random Llamas (CONTRACTS.md).

A user error ends the command with a non-zero status and exactly one stderr line,
`specstop: error: ...`, naming the problem; a success prints the summary line last.  Every
command runs in an empty folder (no params.yaml) unless it names a params file.  Each one spends
a few seconds importing torch, so the selected commands all start at once in a small pool
(`cli`) and each test waits for its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import TINY_CONTEXT
from stop_models import write_stop_model

TINY, OTHER, LONG = "<tiny>", "<other-tokenizer>", "<long-context>"  # the fixture model folders
MODELS = ["--target", TINY, "--draft", TINY, "--dtype", "float32"]
GENERATE = ["generate", *MODELS, "--max-new-tokens", "8"]
HI = [*GENERATE, "--prompt", "hi"]
PARAMS_FILES = {"bad-seed.yaml": "decode:\n  seed: abc\n"}
STOP_MODEL = "stop_model.pt"  # written into the commands' folder (`stop_models.py`)
CHAIN_MODEL = "chain_model.pt"  # the same, its file measured faster with the lookup branch

# case -> (argv, what the error line must say)
ERRORS: dict[str, tuple[list[str], str]] = {
    "empty-prompt": ([*GENERATE, "--prompt", ""], "the prompt is empty"),
    "blank-prompt": ([*GENERATE, "--prompt", " \n\t "], "the prompt is empty"),
    "prompt-over-context": ([*GENERATE, "--prompt", "hello " * 200],
                            f"exceeds the model's context of {TINY_CONTEXT} tokens"),
    "prompt-over-draft-context": (["generate", "--target", LONG, "--draft", TINY, "--dtype",
                                   "float32", "--max-new-tokens", "8", "--prompt", "hello " * 100],
                                  f"exceeds the model's context of {TINY_CONTEXT} tokens (the "
                                  f"draft's max_position_embeddings)"),
    "unknown-method": ([*HI, "--method", "foo"], "--method: expected one of 'ar'"),
    "tokenizer-mismatch": (["generate", "--target", TINY, "--draft", OTHER, "--prompt", "hi"],
                           "use different tokenizers"),
    "missing-model-file": (["generate", "--target", "/nonexistent/model.gguf", "--prompt", "hi"],
                           "model file not found: /nonexistent/model.gguf"),
    "missing-model-folder": (["generate", "--target", "./no/such/folder", "--prompt", "hi"],
                             "model folder not found: ./no/such/folder"),
    "negative-temperature": ([*HI, "--temperature", "-1"], "--temperature: expected 0 (greedy) or a number in"),
    "zero-top-p": ([*HI, "--top-p", "0"], "--top-p: expected a number > 0 and <= 1"),
    "zero-gamma": ([*HI, "--gamma", "0"], "--gamma: expected an integer >= 1"),
    "zero-ti-width": ([*HI, "--method", "ti-mcsd", "--ti-width", "0"], "--ti-width: expected an integer >= 1"),
    "zero-mcsd-branching": ([*HI, "--method", "mcsd", "--mcsd-branching", "2", "0"],
                            "--mcsd-branching: expected an integer >= 1"),
    "unknown-device": ([*HI, "--device", "foo"], "--device: expected auto, cpu, cuda or cuda:N, got 'foo'"),
    "absent-device": ([*HI, "--device", "cuda:99"], "device 'cuda:99' is not available"),
    "params-bad-seed": (["--params", "bad-seed.yaml", *HI],
                        "bad-seed.yaml: decode.seed: expected an integer >= 0"),
    "params-missing-file": (["--params", "missing.yaml", "generate", "--target",
                             "./no/such/folder", "--prompt", "hi"],
                            "params file not found: missing.yaml"),
    "bad-int-flag": ([*HI, "--max-new-tokens", "abc"], "invalid int value: 'abc'"),
    "huge-tree": ([*HI, "--method", "mcsd", "--mcsd-branching", "1000", "1000"],
                  "tree would have"),
    "lookup-branch-not-tree": ([*HI, "--method", "sd", "--lookup-branch"],
                               "a lookup branch (lookup_branch) joins method 'tree' only"),
}
METHODS: dict[str, list[str]] = {
    "ar": [*HI, "--method", "ar"],
    "sd": [*HI, "--method", "sd"],
    "mcsd": [*HI, "--method", "mcsd"],
    "ti-mcsd": [*HI, "--method", "ti-mcsd"],
    "ti-mcsd-lossy": [*HI, "--method", "ti-mcsd", "--lossy"],
}
OTHERS: dict[str, list[str]] = {
    "lookup": ["generate", "--target", TINY, "--draft", "./no/such/folder", "--dtype", "float32",
               "--max-new-tokens", "8", "--method", "lookup", "--gamma", "3", "--prompt",
               "hi hi hi hi hi hi"],
    "bench-decode": ["bench-decode", *MODELS, "--prompt", "hi", "--prompt", "hello there",
                     "--max-new-tokens", "8"],
    "tree-lookup-branch": [*GENERATE, "--method", "tree", "--stop-model", STOP_MODEL,
                           "--lookup-branch", "--prompt", "hi hi hi hi hi hi hi hi"],
    "tree-file-lookup-branch": [*GENERATE, "--method", "tree", "--stop-model", CHAIN_MODEL,
                                "--prompt", "hi hi hi hi hi hi hi hi"],
    "tree-no-lookup-branch": [*GENERATE, "--method", "tree", "--stop-model", CHAIN_MODEL,
                              "--no-lookup-branch", "--prompt", "hi hi hi hi hi hi hi hi"],
}
CASES = {**{name: argv for name, (argv, _) in ERRORS.items()}, **METHODS, **OTHERS}
FLOAT = r"\d+\.\d+"
SUMMARY = re.compile(rf"({FLOAT}) tokens/s, ({FLOAT}) accepted tokens per target call, "
                     rf"acceptance rate ({FLOAT})")
Run = Callable[[str], subprocess.CompletedProcess]


def run_specstop(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specstop.pipeline.cli", *argv], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def selected_cases(items: list[pytest.Item]) -> list[str]:
    """The `case` parameters of this file's tests that pytest will run (all without -k)."""
    return [item.callspec.params["case"] for item in items
            if item.path == Path(__file__) and hasattr(item, "callspec")]


@pytest.fixture(scope="module")
def cli(request: pytest.FixtureRequest, tiny_model_dir: Path, other_tokenizer_model_dir: Path,
        tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """case name -> its finished command; every selected case starts at once."""
    workdir = tmp_path_factory.mktemp("cli-cwd")
    for name, text in PARAMS_FILES.items():
        (workdir / name).write_text(text)
    write_stop_model(workdir / STOP_MODEL)
    write_stop_model(workdir / CHAIN_MODEL, lookup_branch=True, lookup_model={
        "features": ["position", "ngram", "log_gap", "recent"],
        "weights": [0.0, 1.0, 0.0, 1.0], "bias": 0.0})
    folders = {TINY: str(tiny_model_dir), OTHER: str(other_tokenizer_model_dir),
               LONG: str(tiny_target)}
    with ThreadPoolExecutor(max_workers=(os.cpu_count() or 2) + 1) as pool:
        futures: dict[str, Future] = {}

        def start(case: str) -> Future:
            if case not in futures:
                argv = [folders.get(arg, arg) for arg in CASES[case]]
                futures[case] = pool.submit(run_specstop, argv, workdir)
            return futures[case]

        for case in selected_cases(request.session.items):
            start(case)
        yield lambda case: start(case).result()
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("case", ERRORS)
def test_user_error_is_one_line(cli: Run, case: str):
    result = cli(case)
    lines = result.stderr.splitlines()
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("specstop: error: ")
    assert ERRORS[case][1] in lines[0]


@pytest.mark.parametrize("case", METHODS)
def test_generate_ends_with_the_summary(cli: Run, case: str):
    result = cli(case)
    assert result.returncode == 0, result.stderr
    summary = SUMMARY.fullmatch(result.stdout.splitlines()[-1])
    assert summary, result.stdout
    tokens_per_s, per_call, acceptance = map(float, summary.groups())
    assert tokens_per_s > 0
    if case == "ar":
        assert (per_call, acceptance) == (1.0, 0.0)
    else:  # greedy, and the draft is the target itself: every drafted level is accepted
        assert per_call > 1 and acceptance == 1.0


@pytest.mark.parametrize("case", ["lookup"])
def test_lookup_decodes_without_a_draft(cli: Run, case: str):
    """`--method lookup` loads no draft (the one named does not exist) and ends with the
    summary."""
    result = cli(case)
    assert result.returncode == 0, result.stderr
    assert SUMMARY.fullmatch(result.stdout.splitlines()[-1]), result.stdout


@pytest.mark.parametrize("case", ["tree-lookup-branch", "tree-file-lookup-branch",
                                  "tree-no-lookup-branch"])
def test_a_tree_decodes_with_its_lookup_branch(cli: Run, case: str):
    """`--lookup-branch` adds the chain to the exported policy's tree (the prompt repeats, so
    the chain is found), as does a file that measured it faster unless `--no-lookup-branch`;
    the decode ends with the policy's line and the summary."""
    result = cli(case)
    assert result.returncode == 0, result.stderr
    *_, policy_line, summary = result.stdout.splitlines()
    assert SUMMARY.fullmatch(summary), result.stdout
    assert policy_line.startswith("stop model: logistic, tree rule"), result.stdout
    assert ("with the lookup branch" in policy_line) == (case != "tree-no-lookup-branch")


@pytest.mark.parametrize("case", ["bench-decode"])
def test_bench_decode_tables_every_method(cli: Run, case: str):
    result = cli(case)
    assert result.returncode == 0, result.stderr
    head, header, *rows = result.stdout.splitlines()
    assert head.startswith("2 prompts, dtype torch.float32")
    assert header.split() == ["method", "tokens/s", "vs", "ar", "95%", "CI", "acc/call", "accept",
                              "=ar", "logp/tok"]
    table = {" ".join(row.split()[:-7]): row.split()[-7:] for row in rows}  # 7 figures each
    assert list(table) == ["ar", "sd", "mcsd", "ti-mcsd", "ti-mcsd --lossy"]
    assert table["ar"][1:3] == ["1.00", "-"]
    for cells in table.values():  # two prompts: an interval (or none, if every resample agrees)
        if cells[2] != "-":
            low, high = map(float, cells[2].split("-"))
            assert 0 < low <= high
    assert all(cells[-2] == "2/2" for cells in table.values())  # greedy fp32: lossless
    assert len({cells[-1] for cells in table.values()}) == 1  # same outputs, same log-prob
    assert all(float(cells[-1]) < 0 for cells in table.values())
