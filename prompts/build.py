"""Stage `prompts`' work: read the sources, render each request, de-duplicate, split by prompt,
write one Parquet file per split and a summary."""

from __future__ import annotations

from typing import Callable

from specstop.common.params import PromptsConfig

from .sources import parse_sources, read_source
from .splits import SPLITS, check_fractions, split_prompts, summarise, write_split, write_summary


def build_prompts(config: PromptsConfig, render: Callable[[str], str]) -> None:
    """Write `config.out`/{train,val,test}.parquet; `render` turns a request into the text the
    target reads (its chat template)."""
    specs = parse_sources(config.sources)
    fractions = check_fractions(config.fractions)
    sources = [read_source(spec) for spec in specs]
    chosen = split_prompts(sources, fractions, config.seed)
    for split in SPLITS:
        write_split([{"prompt_id": p.prompt_id, "source": p.source, "request": p.request,
                      "text": render(p.request), "split": split}
                     for p in chosen if p.split == split], config.out / f"{split}.parquet")
    summary = summarise(sources, chosen, config.seed, fractions)
    write_summary(summary, config.out / "summary.json")
    for name, counts in summary["sources"].items():
        print(_source_line(name, counts))
    total = ", ".join(f"{split} {n}" for split, n in summary["splits"].items())
    print(f"{len(chosen)} prompts ({total}) -> {config.out}")


def _source_line(name: str, counts: dict) -> str:
    splits = ", ".join(f"{split} {n}" for split, n in counts["splits"].items())
    line = f"{name}: {counts['rows']} rows -> {counts['prompts']} prompts ({splits})"
    skipped = counts["skipped"]
    if skipped:
        line += f"; skipped {sum(skipped.values())}: " + \
            ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    return line
