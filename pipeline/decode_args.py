"""Decoding options shared by `generate` and `bench-decode`: CLI flags over params.yaml defaults."""

from __future__ import annotations

import argparse
from typing import Any, Callable
from pathlib import Path

from specstop.common.errors import SpecstopError
from specstop.decoder.loop import METHODS, DecodeConfig
from specstop.decoder.policy import ConfidenceThreshold, FixedDepth, StoppingPolicy
from specstop.decoder.runtime import Runtime, load_runtime, sampling_from
from specstop.decoder.stop_model import load_stop_model

POLICIES = ("fixed", "confidence")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="embedded, a hub id, a model folder or a .gguf file")
    parser.add_argument("--draft", help="a model (same tokenizer) or layers:N (target truncated)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--max-depth", type=int, help="deepest draft level (tree mask size)")
    parser.add_argument("--policy", choices=POLICIES, help="stopping policy")
    parser.add_argument("--gamma", type=int, help="draft length of the fixed policy")
    parser.add_argument("--threshold", type=float, help="draft-confidence threshold")
    parser.add_argument("--stop-model", help="an exported decision model (TorchScript, "
                        "`specstop export`) as the stopping policy; overrides --policy")
    parser.add_argument("--mcsd-branching", type=int, nargs="+", help="leading mcsd widths")
    parser.add_argument("--ti-width", type=int, help="ti-mcsd branches")
    parser.add_argument("--lossy", action="store_true", default=None,
                        help="ti-mcsd: the published (lossy) DynaSD selection")
    parser.add_argument("--seed", type=int)


def merged(args: argparse.Namespace, defaults: dict, key: str, fallback: Any,
           convert: Callable[[Any], Any] | None = None) -> Any:
    """The CLI flag if given, else params.yaml's value, else the fallback; converted with a
    one-line error naming the option."""
    value = getattr(args, key, None)
    if value is None:
        value = defaults.get(key, fallback)
    if convert is None:
        return value
    try:
        return convert(value)
    except (TypeError, ValueError) as err:
        raise SpecstopError(f"option '{key}': cannot use {value!r} ({err})") from err


def int_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError("expected a list of integers")
    return tuple(int(v) for v in value)


def decode_config(args: argparse.Namespace, decode: dict, method: str) -> DecodeConfig:
    if method not in METHODS:
        raise SpecstopError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    try:
        return DecodeConfig(
            method=method,
            max_new_tokens=merged(args, decode, "max_new_tokens", 128, int),
            sampling=sampling_from(merged(args, decode, "temperature", 0.0, float),
                                   merged(args, decode, "top_p", 1.0, float)),
            max_depth=merged(args, decode, "max_depth", 8, int),
            mcsd_branching=merged(args, decode, "mcsd_branching", [2, 2], int_list),
            ti_width=merged(args, decode, "ti_width", 3, int),
            lossy=bool(merged(args, decode, "lossy", False)),
            without_replacement=bool(decode.get("without_replacement", True)),
        )
    except ValueError as err:
        raise SpecstopError(str(err)) from err


def stopping_policy(args: argparse.Namespace, decode: dict) -> StoppingPolicy:
    stop_model = merged(args, decode, "stop_model", None)
    if stop_model:
        return load_stop_model(Path(stop_model))
    name = merged(args, decode, "policy", "fixed")
    try:
        if name == "fixed":
            return FixedDepth(merged(args, decode, "gamma", 4, int))
        if name == "confidence":
            return ConfidenceThreshold(merged(args, decode, "threshold", 0.4, float))
    except ValueError as err:
        raise SpecstopError(str(err)) from err
    raise SpecstopError(f"unknown policy '{name}' (choose from {', '.join(POLICIES)})")


def seed_from(args: argparse.Namespace, decode: dict) -> int:
    return merged(args, decode, "seed", 0, int)


def runtime_from(args: argparse.Namespace, models: dict, costs: dict, need_draft: bool) -> Runtime:
    return load_runtime(
        target=merged(args, models, "target", "embedded"),
        draft=merged(args, models, "draft", "layers:2") if need_draft else None,
        dtype=merged(args, models, "dtype", "auto"),
        device=merged(args, models, "device", "auto"),
        cache_dir=Path(models.get("cache_dir", "data/models/target")),
        costs=Path(costs.get("path", "data/costs/verify.json")),
    )
