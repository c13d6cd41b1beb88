"""De-duplicate prompts, split them by prompt, write the splits atomically.

The splits keep every learner on prompts of its own: `draft` teaches the draft (stage `draft`),
`train` the decision models (stage `collect` logs them), `val` measures both, `test` is the
bench's; `heldout` holds whole sources of another kind, which only measure the draft (does it
generalise beyond the kinds of request it learned from?), and a `draft_only` source's prompts
are all the draft's (more for it to learn from, the other splits' prompts unmoved). The decision
models must not learn from rounds on prompts the draft was distilled on: it has learned their
responses, and its acceptance there is not the one decoding meets
(`specstop.drafts.store.check_held_out` refuses the overlap).

A prompt's id is a hash of its normalised request text, so it does not change when sources are
added; two requests with the same normalised text are one prompt (the first source keeps it).
Each source is split on its own (stratified), by a shuffle seeded with (seed, source name) of
its sorted ids, so a prompt's split does not depend on the other sources either.
"""

from __future__ import annotations

import hashlib
import random
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specstop.common.errors import SpecstopError
from specstop.common.files import write_atomic, write_json

from .sources import SourceRequests, SourceSpec

SPLITS = ("draft", "train", "val", "test")  # cut from every source by `prompts.fractions`
HELD_OUT = "heldout"  # the prompts of the `held_out` sources, whole: no learner sees their kind
WRITTEN = (*SPLITS, HELD_OUT)  # the files of the stage
SCHEMA = pa.schema([(name, pa.string())
                    for name in ("prompt_id", "source", "request", "text", "split")])
DUPLICATE, OVER_CAP = "duplicate", "over max_prompts"


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    source: str
    request: str
    split: str


def normalise(request: str) -> str:
    """NFKC, with every run of whitespace one space and none at the ends."""
    return " ".join(unicodedata.normalize("NFKC", request).split())


def prompt_id(request: str) -> str:
    return hashlib.sha256(normalise(request).encode("utf-8")).hexdigest()[:16]


def check_fractions(fractions: dict) -> dict[str, float]:
    """{draft, train, val, test} -> non-negative floats, scaled to sum exactly to 1."""
    if not isinstance(fractions, dict) or set(fractions) != set(SPLITS):
        raise SpecstopError(f"prompts.fractions: expected a mapping with keys {', '.join(SPLITS)}")
    try:
        values = {split: float(fractions[split]) for split in SPLITS}
    except (TypeError, ValueError) as err:
        raise SpecstopError(f"prompts.fractions: {err}") from err
    if min(values.values()) < 0 or abs(sum(values.values()) - 1) > 1e-6:
        raise SpecstopError(f"prompts.fractions: must be >= 0 and sum to 1, got {values}")
    total = sum(values.values())
    return {split: value / total for split, value in values.items()}


def split_prompts(sources: list[SourceRequests], fractions: dict[str, float],
                  seed: int) -> list[Prompt]:
    """Every source's unique prompts (capped), each in one split (a `held_out` source's all in
    HELD_OUT, a `draft_only` one's in draft); duplicates and prompts over the cap are counted
    in the source's `skipped`."""
    seen: set[str] = set()
    prompts = []
    for source in sources:
        new = _new_prompts(source, seen)
        order = sorted(new)
        random.Random(f"{seed}:{source.spec.name}").shuffle(order)
        cap = source.spec.max_prompts
        if cap is not None and len(order) > cap:
            source.skipped[OVER_CAP] += len(order) - cap
            order = order[:cap]
        whole = whole_split(source.spec)
        splits = [whole] * len(order) if whole else \
            [split for split, count in zip(SPLITS, split_counts(len(order), fractions))
             for _ in range(count)]
        prompts += [Prompt(pid, source.spec.name, new[pid], split)
                    for pid, split in zip(order, splits)]
    return prompts


def whole_split(spec: SourceSpec) -> str | None:
    """The one split that takes all of a source's prompts, or None: cut by the fractions."""
    return HELD_OUT if spec.held_out else "draft" if spec.draft_only else None


def _splits_of(spec: SourceSpec) -> tuple[str, ...]:
    whole = whole_split(spec)
    return (whole,) if whole else SPLITS


def _new_prompts(source: SourceRequests, seen: set[str]) -> dict[str, str]:
    """id -> request of the source's prompts not in `seen` (then added to it); every other
    request is counted as a duplicate."""
    new: dict[str, str] = {}
    for request in source.requests:
        pid = prompt_id(request)
        if pid in seen or pid in new:
            source.skipped[DUPLICATE] += 1
        else:
            new[pid] = request
    seen.update(new)
    return new


def split_counts(n: int, fractions: dict[str, float]) -> list[int]:
    """n cut by the fractions (largest remainder), in SPLITS order."""
    exact = [n * fractions[split] for split in SPLITS]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(SPLITS)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def write_split(rows: list[dict[str, str]], path: Path) -> None:
    """One split as Parquet (columns of SCHEMA), atomically."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def interleave(sources: list[str]) -> list[int]:
    """Indices of the rows, one of each source in turn (each source in its row order)."""
    by_source: dict[str, list[int]] = {}
    for i, source in enumerate(sources):
        by_source.setdefault(source, []).append(i)
    queues = list(by_source.values())
    return [q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)]


def read_split(prompts_dir: Path, split: str,
               columns: tuple[str, ...] = ("prompt_id", "text")) -> dict[str, list[str]]:
    """Some columns of one split (by default `prompt_id` and the chat-rendered `text`), in file
    order."""
    path = Path(prompts_dir) / f"{split}.parquet"
    if not path.is_file():
        raise SpecstopError(f"{path}: prompts not found (run `specstop prompts` first)")
    missing = set(columns) - set(pq.read_schema(path).names)
    if missing:
        raise SpecstopError(f"{path}: no column '{sorted(missing)[0]}' (re-run `specstop prompts`)")
    return pq.read_table(path, columns=list(columns)).to_pydict()


def write_summary(summary: dict, path: Path) -> None:
    write_json(path, summary)


def summarise(sources: list[SourceRequests], prompts: list[Prompt], seed: int,
              fractions: dict[str, float]) -> dict:
    """Counts per split and per source (a held-out source's in `heldout` alone), and rows
    skipped by reason."""
    per_source = Counter((p.source, p.split) for p in prompts)
    return {
        "seed": seed,
        "fractions": fractions,
        "splits": {split: sum(p.split == split for p in prompts) for split in WRITTEN},
        "sources": {
            s.spec.name: {
                "origin": s.spec.describe(),
                "rows": s.rows,
                "prompts": sum(per_source[s.spec.name, split] for split in WRITTEN),
                "splits": {split: per_source[s.spec.name, split]
                           for split in _splits_of(s.spec)},
                "skipped": dict(sorted(s.skipped.items())),
            } for s in sources},
    }
