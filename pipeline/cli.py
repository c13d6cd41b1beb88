"""The `specstop` command: one subcommand per pipeline stage, plus `generate` and `bench-decode`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # before transformers is imported

from specstop.common.errors import SpecstopError
from specstop.common.params import Params
from specstop.decoder.loop import DecodeConfig

from .decode_args import positive_int, with_flags
from .outputs import check_outputs
from .params import DEFAULT_PARAMS, checked_params, read_params_file
from .sizes import sized
from .stage_record import read_records, timed_stage


STAGES = {  # DVC stages, in pipeline order; each is the module pipeline/<name>.py
    "prepare": "convert the embedded target, measure verify costs",
    "prompts": "read, de-duplicate and split the prompt sources",
    "draft": "build, distil and compare drafts; keep the fastest",
    "collect": "log draft features and acceptance (torchrun-able)",
    "train": "train and compare early-stop decision models (MLflow)",
    "export": "every decision model to TorchScript; register the winner",
    "bench": "every method and decision model on the test prompts",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, like every other error of the CLI."""

    def error(self, message: str):
        print(f"specstop: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from .decode_args import add_decode_args, add_model_args
    from specstop.common.params import METHODS

    parser = OneLineErrorParser(prog="specstop", description=__doc__)
    parser.add_argument("--params", type=Path, default=None,
                        help=f"params file (default: {DEFAULT_PARAMS} if present)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)

    for stage, text in STAGES.items():
        sub.add_parser(stage, help=f"stage: {text}")
    sub.choices["collect"].add_argument(
        "--launch", action="store_true", help="run as collect.processes processes under "
        "torchrun (auto: one per GPU, else per usable core, as many as the memory holds)")

    gen = sub.add_parser("generate", help="decode one prompt and print the text")
    gen.add_argument("--method", default=None, help=f"one of {', '.join(METHODS)}")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_model_args(gen)
    add_decode_args(gen)

    work = sub.add_parser("workspace", help="copy the project into DIR with a params profile "
                                            "applied, to `dvc repro` there (e.g. --profile smoke)")
    work.add_argument("dir", type=Path, help="a new or empty folder")
    work.add_argument("--profile", default=None, help="a profile of params.yaml's `profiles`")

    results = sub.add_parser("results", help="write the bench's table (bench.metrics) into the "
                                             "README's results section")
    results.add_argument("--readme", type=Path, default=Path("README.md"))

    bench = sub.add_parser("bench-decode", help="tokens/s of every method side by side")
    bench.add_argument("--methods", nargs="+",
                       default=["ar", "sd", "mcsd", "ti-mcsd", "ti-mcsd-lossy"],
                       help="methods to compare; ti-mcsd-lossy is ti-mcsd --lossy")
    bench.add_argument("--prompts", type=positive_int, default=3,
                       help="number of HumanEval prompts")
    bench.add_argument("--prompt", action="append", help="a prompt (repeatable) instead")
    bench.add_argument("--execute-code", action="store_true",
                       help="also run HumanEval's tests on every output (executes generated "
                            "code, each program in a separate process with time/memory limits)")
    add_model_args(bench)
    add_decode_args(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.params or DEFAULT_PARAMS
    try:
        raw = read_params_file(path, required=args.params is not None)
        params = checked_params(raw, path)  # the whole file, before any work
        if args.command in STAGES:  # each stage is the module of its name: run(params)
            stage = importlib.import_module(f".{args.command}", __package__)
            check_outputs(args.command, params)  # writable, before any work
            if getattr(args, "launch", False):
                stage.launch(params, args.params)  # becomes torchrun where that pays
            params, scaled = sized(args.command, params)
            timed_stage(args.command, lambda: stage.run(params), scaled)
        elif args.command == "generate":
            _generate(args, with_flags(params, args, str(path)))
        elif args.command == "workspace":
            _workspace(args, raw)
        elif args.command == "results":
            _results(args, params)
        elif args.command == "bench-decode":
            _bench_decode(args, with_flags(params, args, str(path)))
    except SpecstopError as err:
        print(f"specstop: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specstop: interrupted; outputs already written are kept", file=sys.stderr)
        return 130
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()


def _generate(args: argparse.Namespace, params: Params) -> None:
    from specstop.decoder.methods import round_method
    from specstop.decoder.runtime import decode_config
    from specstop.decoder.stop_model import LearnedPolicy
    from specstop.drafts.loading import runtime_from
    from .decode_args import lookup_branch, stopping_policy

    _quiet_transformers()
    decode = params.decode
    policy = stopping_policy(decode)
    config = decode_config(decode, decode.method, lookup_branch(decode, decode.method, policy))
    runtime = runtime_from(params.models, params.costs,
                           need_draft=round_method(decode.method).drafts)
    prompt = runtime.encode(args.prompt, chat=not args.no_chat)
    generation = runtime.generate(prompt, config, policy, decode.seed)
    print(runtime.tokenizer.decode(generation.tokens, skip_special_tokens=True))
    stats = generation.stats
    if isinstance(policy, LearnedPolicy):
        print(policy.tree_summary(stats.decision_seconds, stats.seconds, stats.gated,
                                  stats.target_calls - 1,  # the prefill is no round
                                  config.sampling.greedy, config.lookup_branch)
              if config.method == "tree" else policy.summary())
    print(stats.summary())


def _workspace(args: argparse.Namespace, raw: dict) -> None:
    from .workspace import make_workspace

    root = (args.params or DEFAULT_PARAMS).resolve().parent
    dest = make_workspace(root, args.dir, args.profile, raw)
    print(f"workspace {dest} ({args.profile or 'no'} profile): cd {dest} && dvc repro")


def _results(args: argparse.Namespace, params: Params) -> None:
    import json

    from specstop.bench.report import update_readme
    from specstop.common.files import require

    path = require(params.bench.metrics, "bench")
    try:
        metrics = json.loads(path.read_text())
    except ValueError as err:
        raise SpecstopError(f"{path}: not valid JSON ({err})") from err
    if "summary" not in metrics:
        raise SpecstopError(f"{path}: no `summary` block (written by an older bench; re-run it)")
    if not args.readme.is_file():
        raise SpecstopError(f"{args.readme}: not found (give --readme)")
    records = read_records(order=tuple(STAGES))
    for record in records.values():  # a torchrun worker's threads are not another machine
        record["machine"].pop("torch_threads", None)
    update_readme(args.readme, metrics, records)
    print(f"{args.readme}: results section rewritten from {path}")


def _bench_decode(args: argparse.Namespace, params: Params) -> None:
    from specstop.decoder.runtime import decode_config
    from specstop.drafts.loading import runtime_from
    from specstop.evaluation.side_by_side import bench, humaneval_problems, score_humaneval, table
    from specstop.prompts.sources import humaneval_request
    from .decode_args import lookup_branch, stopping_policy

    _quiet_transformers()
    if args.execute_code and args.prompt:
        raise SpecstopError("--execute-code needs HumanEval prompts, not --prompt")
    decode = params.decode
    methods = ["ar", *[m for m in args.methods if m != "ar"]]
    policy = stopping_policy(decode)
    configs = [_with_lossy(decode_config(decode, m.removesuffix(LOSSY_SUFFIX),
                                         m == "tree" and lookup_branch(decode, m, policy)),
                           m.endswith(LOSSY_SUFFIX)) for m in methods]
    runtime = runtime_from(params.models, params.costs, need_draft=len(methods) > 1)
    problems = [] if args.prompt else humaneval_problems(args.prompts)
    texts = args.prompt or [humaneval_request(p) for p in problems]
    prompts = [runtime.encode(t) for t in texts]
    results = bench(runtime, prompts, configs, policy, decode.seed)
    if args.execute_code:
        score_humaneval(runtime, results, problems)
    print(f"{len(prompts)} prompts, dtype {runtime.target.dtype}, device {runtime.target.device}")
    print(table(results, len(prompts), with_pass=args.execute_code))


LOSSY_SUFFIX = "-lossy"


def _with_lossy(config: DecodeConfig, lossy: bool) -> DecodeConfig:
    return dataclasses.replace(config, lossy=lossy) if lossy else config


if __name__ == "__main__":
    sys.exit(main())
