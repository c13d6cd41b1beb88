"""Stage `prompts`' work: read the sources (a magpie source through the target), render each
request, de-duplicate, split by prompt, write one Parquet file per split (its sources
interleaved) and a summary."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from specstop.common.errors import SpecstopError
from specstop.common.params import PromptsConfig

from .self_written import Writer, read_self_written
from .sources import SourceRequests, SourceSpec, parse_sources, read_source
from .splits import (WRITTEN, Prompt, check_fractions, interleave, split_prompts, summarise,
                     write_split, write_summary)


def build_prompts(config: PromptsConfig, render: Callable[[str], str],
                  writer: Writer | None = None,
                  readers: dict[str, str] | None = None) -> dict[str, int]:
    """Write `config.out`/{draft,train,val,test,heldout}.parquet; `render` turns a request into
    the text the target reads (its chat template), `writer` (the target) writes a magpie
    source's requests; a split in `readers` (split -> who reads it) must not be empty.
    Returns the number of prompts, in all and per split."""
    specs = parse_sources(config.sources)
    fractions = check_fractions(config.fractions)
    sources = [_read(spec, config, writer) for spec in specs]
    chosen = split_prompts(sources, fractions, config.seed)
    _check_not_empty(chosen, readers or {})
    for split in WRITTEN:
        write_split([{"prompt_id": p.prompt_id, "source": p.source, "request": p.request,
                      "text": render(p.request), "split": split}
                     for p in _interleaved([p for p in chosen if p.split == split])],
                    config.out / f"{split}.parquet")
    summary = summarise(sources, chosen, config.seed, fractions)
    write_summary(summary, config.out / "summary.json")
    for name, counts in summary["sources"].items():
        print(_source_line(name, counts))
    total = ", ".join(f"{split} {n}" for split, n in summary["splits"].items())
    print(f"{len(chosen)} prompts ({total}) -> {config.out}")
    return {"prompts": len(chosen), **summary["splits"]}


def _check_not_empty(chosen: list[Prompt], readers: dict[str, str]) -> None:
    """Refuse, before any split is written, an empty split that a reader needs."""
    counts = Counter(p.split for p in chosen)
    for split, reader in readers.items():
        if not counts[split]:
            raise SpecstopError(f"prompts: the {split} split would be empty ({len(chosen)} "
                                f"distinct prompts in all, cut by prompts.fractions) and "
                                f"{reader} reads it; add prompts to prompts.sources")


def _interleaved(prompts: list[Prompt]) -> list[Prompt]:
    """A split's prompts, one of each source in turn: every prefix of the file (the part a
    `max_prompts` cap keeps) mixes the sources."""
    return [prompts[i] for i in interleave([p.source for p in prompts])]


def _read(spec: SourceSpec, config: PromptsConfig, writer: Writer | None) -> SourceRequests:
    if spec.sampling is None:
        return read_source(spec)
    if writer is None:
        raise SpecstopError(f"{spec.describe()}: needs the target to write its requests")
    return read_self_written(spec, config.out, config.seed, writer)


def _source_line(name: str, counts: dict) -> str:
    splits = ", ".join(f"{split} {n}" for split, n in counts["splits"].items())
    line = f"{name}: {counts['rows']} rows -> {counts['prompts']} prompts ({splits})"
    skipped = counts["skipped"]
    if skipped:
        line += f"; skipped {sum(skipped.values())}: " + \
            ", ".join(f"{n} {reason}" for reason, n in skipped.items())
    return line
