"""Stage `prompts`: read the prompt sources, render each request through the target's chat
template, de-duplicate, split by prompt, write one Parquet file per split and a summary."""

from __future__ import annotations

from specstop.common.params import Params
from specstop.decoder.models import chat_text, load_tokenizer

from .prompt_sources import parse_sources, read_source
from .prompt_splits import (SPLITS, check_fractions, split_prompts, summarise, write_split,
                            write_summary)


def run(params: Params) -> None:
    prompts, models = params.prompts, params.models
    out, seed = prompts.out, prompts.seed
    specs = parse_sources(prompts.sources)
    fractions = check_fractions(prompts.fractions)
    tokenizer = load_tokenizer(models.target, models.target_cache)
    sources = [read_source(spec) for spec in specs]
    chosen = split_prompts(sources, fractions, seed)
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
