"""The CLI's decoding options for `generate` and `bench-decode`: flags over params.yaml's
`decode` and `models` sections, checked by the params schema, and the policy they name."""

from __future__ import annotations

import argparse

from specstop.common.errors import SpecstopError
from specstop.common.params import DecodeParams, Params, with_overrides
from specstop.decoder.policy import (ConfidenceThreshold, FixedDepth, StoppingPolicy,
                                     exported_lookup_branch)
from specstop.decoder.stop_model import load_stop_model

MODEL_FLAGS = ("target", "draft", "dtype", "device", "cpu_kernel", "compile")
DECODE_FLAGS = ("method", "max_new_tokens", "temperature", "top_p", "max_depth", "policy",
                "gamma", "threshold", "stop_model", "mcsd_branching", "ti_width", "lossy",
                "lookup_branch", "seed")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a count of prompts, say)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="embedded, a hub id, a model folder or a .gguf file")
    parser.add_argument("--draft", help="a model (same tokenizer) or layers:N (target truncated)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--cpu-kernel", choices=["onednn", "aten"],
                        help="linear layers on a CPU: oneDNN, weights prepacked (default), or aten")
    parser.add_argument("--compile", choices=["auto", "on", "off"],
                        help="capture the decoding forwards with torch.compile, as CUDA graphs on "
                        "CUDA (auto: on CUDA only)")


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--max-depth", type=int, help="deepest draft level (tree mask size)")
    parser.add_argument("--policy", help="stopping policy: fixed or confidence")
    parser.add_argument("--gamma", type=int, help="draft length of the fixed policy")
    parser.add_argument("--threshold", type=float, help="draft-confidence threshold")
    parser.add_argument("--stop-model", help="an exported decision model (TorchScript, "
                        "`specstop export`) as the stopping policy; overrides --policy")
    parser.add_argument("--mcsd-branching", type=int, nargs="+", help="leading mcsd widths")
    parser.add_argument("--ti-width", type=int, help="ti-mcsd branches")
    parser.add_argument("--lossy", action="store_true", default=None,
                        help="ti-mcsd: the published (lossy) DynaSD selection")
    parser.add_argument("--lookup-branch", action=argparse.BooleanOptionalAction, default=None,
                        help="tree: add the prompt-lookup chain below the root as one more "
                             "branch, cut by the stop model's lookup model (default: where the "
                             "stop model's file measured it faster)")
    parser.add_argument("--seed", type=int)


def with_flags(params: Params, args: argparse.Namespace, source: str) -> Params:
    """`params` with the CLI flags that were given, checked by the schema (errors name the flag)."""
    def given(names: tuple[str, ...]) -> dict:
        return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}

    return with_overrides(params, source, decode=given(DECODE_FLAGS), models=given(MODEL_FLAGS))


def lookup_branch(decode: DecodeParams, method: str, policy: StoppingPolicy) -> bool:
    """Whether a decode adds the lookup branch: as `decode.lookup_branch` says, or where it is
    `auto`, in `tree` decodes whose stop model's file measured it faster in this sampling."""
    if decode.lookup_branch != "auto":
        if decode.lookup_branch and method != "tree":  # a static tree's is collect's alone
            raise SpecstopError(f"a lookup branch (lookup_branch) joins method 'tree' only, "
                                f"not '{method}'")
        return decode.lookup_branch
    return method == "tree" and exported_lookup_branch(policy, decode.temperature == 0.0)


def stopping_policy(decode: DecodeParams) -> StoppingPolicy:
    """The exported decision model if one is named (for `tree`: its tree rule), else the fixed
    or confidence policy."""
    if decode.stop_model is not None:
        return load_stop_model(decode.stop_model)
    if decode.method == "tree":
        raise SpecstopError("--method tree needs --stop-model FILE (an exported decision model; "
                            "its tree rule decides what to draft and verify)")
    if decode.policy == "confidence":
        return ConfidenceThreshold(decode.threshold)
    return FixedDepth(decode.gamma)
