"""Requests the target writes itself (Magpie, arXiv 2406.08464): given only its chat template's
text up to the start of a user turn, an aligned chat model samples what a user would ask, up to
its end-of-turn token.

Here are the model-free parts: cutting a request out of a sample, the filters, the loop that asks
a sampler for seeded batches until enough distinct requests are usable, and the cache (a stage
output, reused while its settings match).  The sampler itself comes from the stage
(`pipeline/prompts.py`): prompts/ imports only common.

A sample is skipped and counted under the first of these it fails:
  truncated           no end-of-turn marker within max_new_tokens
  empty               blank after strip
  too few words       under MIN_WORDS words
  mostly non-letters  letters are under MIN_LETTERS of its non-space characters
  repeated 3-gram     one word 3-gram (case-folded) occurs more than MAX_REPEATS times
  few distinct words  DISTINCT_FROM words or more, of which under MIN_DISTINCT are distinct
  duplicate           the same text (splits.normalise) as an earlier request
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from specstop.common.errors import SpecstopError
from specstop.common.files import write_atomic

from .sources import Sampling, SourceRequests, SourceSpec
from .splits import DUPLICATE, normalise

TRUNCATED, EMPTY = "truncated", "empty"
MIN_WORDS = 3
MIN_LETTERS = 0.5
MAX_REPEATS = 3
DISTINCT_FROM, MIN_DISTINCT = 10, 0.4
SAMPLES_PER_REQUEST = 4  # the sampling budget: at most this many samples per request asked for

Sample = Callable[[int, int], list[str]]  # (n, seed) -> n decoded samples, special tokens kept


@dataclass(frozen=True)
class Writer:
    """The model that writes requests: what identifies it in the cache (model, dtype, device),
    and how to load its sampler for some settings: (sample, the markers that end a turn)."""

    identity: dict[str, str]
    load: Callable[[Sampling], tuple[Sample, tuple[str, ...]]]


@dataclass
class Written:
    """The usable distinct requests in sampling order, the samples looked at, and the skipped."""

    rows: int = 0
    requests: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


def extract_request(sample: str, ends: tuple[str, ...]) -> str | None:
    """A sample's text before its first end-of-turn marker, stripped; None without one."""
    cuts = [sample.find(end) for end in ends if end in sample]
    return sample[:min(cuts)].strip() if cuts else None


def rejection(request: str) -> str:
    """The first filter (module docstring) a cut request fails, "" for a usable one."""
    if not request:
        return EMPTY
    words = request.lower().split()
    if len(words) < MIN_WORDS:
        return "too few words"
    chars = "".join(words)
    if sum(c.isalpha() for c in chars) < MIN_LETTERS * len(chars):
        return "mostly non-letters"
    if max(Counter(zip(words, words[1:], words[2:])).values()) > MAX_REPEATS:
        return "repeated 3-gram"
    if len(words) >= DISTINCT_FROM and len(set(words)) < MIN_DISTINCT * len(words):
        return "few distinct words"
    return ""


def batch_seed(seed: int, name: str, batch: int) -> int:
    """The seed of one batch: a hash of (seed, source name, batch), so no two seeds share one."""
    digest = hashlib.sha256(f"{seed}:{name}:{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def write_requests(sample: Sample, ends: tuple[str, ...], count: int, batch_size: int,
                   seed: int, name: str) -> Written:
    """Seeded batches from `sample` until `count` requests pass the filters, or the budget of
    SAMPLES_PER_REQUEST samples per request is spent; the rest of the last batch is unread."""
    written, seen = Written(), set()
    batches = math.ceil(SAMPLES_PER_REQUEST * count / batch_size)
    with tqdm(total=count, desc=name, unit="request", file=sys.stderr) as bar:
        for batch in range(batches):
            for text in sample(batch_size, batch_seed(seed, name, batch)):
                written.rows += 1
                request = extract_request(text, ends)
                reason = TRUNCATED if request is None else rejection(request)
                if not reason and normalise(request) in seen:
                    reason = DUPLICATE
                if reason:
                    written.skipped[reason] += 1
                    continue
                seen.add(normalise(request))
                written.requests.append(request)
                bar.update()
                if len(written.requests) == count:
                    return written
    return written


def read_self_written(spec: SourceSpec, out: Path, seed: int, writer: Writer) -> SourceRequests:
    """A magpie source's requests: from its cache file under `out` where that was written with
    these settings, else sampled (the model loaded only then) and cached."""
    settings = {"seed": seed, "count": spec.max_prompts, **writer.identity,
                **asdict(spec.sampling)}
    path = cache_path(out, spec.name)
    written = read_cache(path, settings)
    if written is None:
        sample, ends = writer.load(spec.sampling)
        written = write_requests(sample, ends, spec.max_prompts, spec.sampling.batch_size,
                                 seed, spec.name)
        write_cache(path, settings, written)
    why = ", ".join(f"{n} {reason}" for reason, n in written.skipped.most_common())
    if not written.requests:
        raise SpecstopError(f"{spec.describe()}: no usable request in {written.rows} samples "
                            f"({why}); raise max_new_tokens or try another target")
    if len(written.requests) < spec.max_prompts:
        print(f"specstop: {spec.name}: {len(written.requests)} of {spec.max_prompts} requests "
              f"within {written.rows} samples ({why})", file=sys.stderr)
    return SourceRequests(spec, written.rows, list(written.requests), Counter(written.skipped))


def cache_path(out: Path, name: str) -> Path:
    return Path(out) / f"{name}.requests.json"


def read_cache(path: Path, settings: dict) -> Written | None:
    """The cached requests where `path` holds them for exactly `settings`, else None."""
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached["settings"] != settings:
            return None
        return Written(int(cached["rows"]), [str(r) for r in cached["requests"]],
                       Counter({str(k): int(v) for k, v in cached["skipped"].items()}))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # absent or not ours
        return None


def write_cache(path: Path, settings: dict, written: Written) -> None:
    value = {"settings": settings, "rows": written.rows,
             "skipped": dict(written.skipped.most_common()), "requests": written.requests}
    write_atomic(path, lambda tmp: tmp.write_text(
        json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"))
