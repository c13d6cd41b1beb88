"""Stage `prompts`: read the prompt sources, render each request through the target's chat
template, de-duplicate, split by prompt, write one Parquet file per split and a summary."""

from __future__ import annotations

from pathlib import Path

from specstop.common.errors import SpecstopError
from specstop.decoder.models import chat_text, load_tokenizer

from .params import section
from .prompt_sources import parse_sources, read_source
from .prompt_splits import (SPLITS, check_fractions, split_prompts, summarise, write_split,
                            write_summary)

DEFAULT_SOURCES = [{"embedded": "humaneval"}]
DEFAULT_FRACTIONS = {"train": 0.7, "val": 0.15, "test": 0.15}


def run(params: dict) -> None:
    prompts, models = section(params, "prompts"), section(params, "models")
    out = Path(prompts.get("out", "data/prompts"))
    specs = parse_sources(prompts.get("sources", DEFAULT_SOURCES))
    fractions = check_fractions(prompts.get("fractions", DEFAULT_FRACTIONS))
    try:
        seed = int(prompts.get("seed", 0))
    except (TypeError, ValueError) as err:
        raise SpecstopError(f"prompts.seed: {err}") from err
    sources = [read_source(spec) for spec in specs]
    chosen = split_prompts(sources, fractions, seed)
    tokenizer = load_tokenizer(models.get("target", "embedded"),
                               Path(models.get("cache_dir", "data/models/target")))
    for split in SPLITS:
        write_split([{"prompt_id": p.prompt_id, "source": p.source, "request": p.request,
                      "text": chat_text(tokenizer, p.request), "split": split}
                     for p in chosen if p.split == split], out / f"{split}.parquet")
    summary = summarise(sources, chosen, seed, fractions)
    write_summary(summary, out / "summary.json")
    for name, counts in summary["sources"].items():
        print(_source_line(name, counts))
    total = ", ".join(f"{split} {n}" for split, n in summary["splits"].items())
    print(f"{len(chosen)} prompts ({total}) -> {out}")


def _source_line(name: str, counts: dict) -> str:
    splits = ", ".join(f"{split} {n}" for split, n in counts["splits"].items())
    line = f"{name}: {counts['rows']} rows -> {counts['prompts']} prompts ({splits})"
    skipped = counts["skipped"]
    if skipped:
        line += f"; skipped {sum(skipped.values())}: " + \
            ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    return line
