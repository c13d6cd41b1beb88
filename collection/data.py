"""Logged rows as training and replay data: features, labels, splits by prompt, NaN handling.

A split is the `split` column written by stage `collect` (prompts were assigned to splits in
stage `prompts`, so no prompt is in two splits: that is checked).  Training rows are the labelled
rows (`label >= 0`) for hard labels and every row for soft labels (min(1, p/q) is the
acceptance probability given the branch so far, defined after a rejection too).  A round with
any non-finite feature (or soft label) is dropped whole, from training and from the replay, and
counted; the count is logged.  A dataset holds the rounds of one temperature (`collect` logs
greedy and sampled rounds of the same prompts; greedy by default).

The read is lean, for logs larger than the few hundred thousand rows of the default pipeline:
every part's footer is validated first (no data read); one pass over the `prompt_id` and `split`
columns counts the rows of each split and checks that no prompt is in two splits; then each
split is streamed part by part, row group by row group, with only the columns training uses and
the split pushed into the Parquet scan as a filter (row groups of another split are skipped by
their statistics), into arrays allocated once at their final size.  Peak memory is about the
final arrays (~120 bytes per row: 26 float32 features, the ids and labels), not an Arrow table
plus pandas copies of it.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from specstop.features import FEATURES, SCHEMA_VERSION
from specstop.common.errors import DataError

from .rows import LOOKUP, check_part, corrupt

FEATURE_NAMES = [f.name for f in FEATURES]
LABEL_TYPES = ("hard", "soft")
SPLITS = ("train", "val")
ROUND_KEYS = ["prompt_id", "round"]
COLUMNS = ["prompt_id", "split", "round", "node", "parent", "token", "label", "soft_label",
           "accept_prob", "temperature", *FEATURE_NAMES]  # the columns of Split.rows, in order
ID_DTYPES = {"round": np.int32, "node": np.int16, "parent": np.int16, "token": np.int32,
             "label": np.int8,
             "soft_label": np.float32, "accept_prob": np.float32,
             "temperature": np.float32}  # as in rows.ROW_SCHEMA
BATCH_ROWS = 65_536  # rows per streamed batch (a row group is read at a time)
POOL = pa.system_memory_pool()  # malloc: memory of a batch read goes back, mimalloc hoards it
PARQUET = pads.ParquetFileFormat(read_options=pads.ParquetReadOptions(
    dictionary_columns=["prompt_id", "split"]))  # ids as codes: no string per row is built
SCAN = pads.ParquetFragmentScanOptions(pre_buffer=False)  # local files: no row group held twice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """The rows of one split, ordered by (prompt, round, node): level-major within a round.

    `rows` holds the ids, labels and features (prompt_id and split as categoricals); its
    feature columns are views of `matrix`, [n, F] float32, Fortran-ordered (one contiguous
    column per feature)."""

    name: str
    rows: pd.DataFrame
    matrix: np.ndarray = field(repr=False, compare=False)

    @property
    def features(self) -> np.ndarray:  # [n, F] float32, every row (read-only, not copied)
        view = self.matrix.view()
        view.flags.writeable = False
        return view

    def examples(self, label: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(X [m, F], y [m] in [0, 1], prompt group [m]) of the training rows for a label type."""
        if label == "hard":
            keep = self.rows["label"].to_numpy() >= 0
            y = self.rows["label"].to_numpy()[keep] == 1
        else:
            keep = None
            y = self.rows["soft_label"].to_numpy()
        return self._features(keep), y.astype(np.float32), self._prompts(keep)

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        """(X, hard label) of the labelled rows: what the greedy runtime's truth scores."""
        label = self.rows["label"].to_numpy()
        keep = label >= 0
        return self._features(keep), label[keep].astype(np.int8)

    def _prompts(self, keep: np.ndarray | None) -> np.ndarray:
        """[m] object array of prompt ids, one shared string per prompt (8 bytes a row)."""
        column = self.rows["prompt_id"]
        codes = column.cat.codes.to_numpy()
        return np.asarray(column.cat.categories, dtype=object)[codes if keep is None else
                                                               codes[keep]]

    def _features(self, keep: np.ndarray | None) -> np.ndarray:
        """[m, F] float32 of the rows `keep` selects (all: a read-only view), Fortran-ordered."""
        if keep is None:
            return self.features
        return np.compress(keep, self.features.T, axis=1).T  # one [F, m] copy, as [m, F]


@dataclass(frozen=True)
class Dataset:
    train: Split
    val: Split
    digest: str
    schema_version: int
    dropped_rounds: int


def load(folder: Path, label: str = "hard", temperature: float = 0.0) -> Dataset:
    """Read, validate and split the rounds of `folder/parts` decoded at `temperature` (0:
    greedy); DataError names the folder (or the part file) and the problem."""
    if label not in LABEL_TYPES:
        raise DataError(f"train.label must be one of {LABEL_TYPES}, got '{label}'")
    folder = Path(folder)
    parts = sorted((folder / "parts").glob("*.parquet"))
    if not parts:
        raise DataError(f"{folder}: no logged parts (run `specstop collect` first)")
    for part in parts:
        check_part(part)
    counts, prompts = _census(parts, folder)
    if not sum(counts.values()):
        raise DataError(f"{folder}/parts: the parts hold no rows")
    splits, dropped = {}, 0
    for name in SPLITS:
        splits[name], lost = _split(parts, name, counts[name], prompts, folder, label,
                                    temperature)
        dropped += lost
    if dropped:
        log.warning("%s: dropped %d round(s) with non-finite features or labels", folder, dropped)
    return Dataset(splits["train"], splits["val"], digest(folder), SCHEMA_VERSION, dropped)


def check_temperatures(folder: Path, temperatures: list[float], keys: str) -> None:
    """DataError unless the parts of `folder` hold rounds at every one of `temperatures` (the
    params `keys` name), read from the temperature column alone."""
    logged: set[float] = set()
    for path in sorted((Path(folder) / "parts").glob("*.parquet")):
        for batch in _batches(path, ["temperature"]):
            logged.update(pc.unique(batch.column("temperature")).to_pylist())
    missing = [t for t in temperatures if float(np.float32(t)) not in logged]
    if missing:
        found = ", ".join(f"{t:g}" for t in sorted(logged)) or "none"
        raise DataError(f"{folder}: no rounds logged at temperature {missing[0]:g} ({keys}; "
                        f"the parts hold {found}: add it to collect.temperatures)")


def digest(folder: Path) -> str:
    """sha256 over the part files (names and bytes), their lookup rows and the cost model
    (read in chunks)."""
    h = hashlib.sha256()
    parts = Path(folder) / "parts"
    files = sorted(parts.glob("*.parquet")) + sorted((parts / LOOKUP).glob("*.parquet")) \
        + [Path(folder) / "costs.json"]
    for path in files:
        if path.is_file():
            h.update(path.name.encode())
            with open(path, "rb") as file:
                while chunk := file.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def _batches(path: Path, columns: list[str], split: str | None = None) -> Iterator[pa.RecordBatch]:
    """`columns` of one part, one batch at a time in file order; `split` is pushed into the
    scan (row groups whose statistics exclude it are not read).  A part that cannot be decoded
    is a DataError naming it."""
    try:
        scanner = pads.dataset(path, format=PARQUET).scanner(
            columns=columns, filter=None if split is None else pc.field("split") == split,
            batch_size=BATCH_ROWS, use_threads=False, batch_readahead=1, fragment_readahead=1,
            memory_pool=POOL, fragment_scan_options=SCAN)
        yield from scanner.to_batches()
    except (pa.ArrowException, OSError) as err:
        raise corrupt(path, err) from err


def _census(parts: list[Path], folder: Path) -> tuple[Counter, np.ndarray]:
    """(rows per split, every prompt id sorted) from the prompt_id and split columns alone;
    DataError if a prompt is in more than one split."""
    pairs: Counter = Counter()
    for path in parts:
        for batch in _batches(path, ["prompt_id", "split"]):
            prompt, split = _codes(batch, "prompt_id", path), _codes(batch, "split", path)
            width = len(split.dictionary)
            pair = prompt.indices.to_numpy().astype(np.int64) * width + split.indices.to_numpy()
            counts = np.bincount(pair, minlength=len(prompt.dictionary) * width)
            for code in np.flatnonzero(counts):
                pairs[(prompt.dictionary[code // width].as_py(),
                       split.dictionary[code % width].as_py())] += int(counts[code])
    splits_of: dict[str, set] = {}
    counts: Counter = Counter()
    for (prompt, split), n in pairs.items():
        splits_of.setdefault(prompt, set()).add(split)
        counts[split] += n
    shared = sorted(p for p, s in splits_of.items() if len(s) > 1)
    if shared:
        raise DataError(f"{folder}: prompt '{shared[0]}' is in more than one split "
                        f"({len(shared)} such prompts); splits must be by prompt")
    return counts, np.array(sorted(splits_of), dtype=object)


def _split(parts: list[Path], name: str, n: int, prompts: np.ndarray, folder: Path,
           label: str, temperature: float) -> tuple[Split, int]:
    """One split streamed into its final arrays, sorted, the rows of other temperatures and the
    non-finite rounds dropped; with the number of rounds dropped."""
    codes = np.empty(n, np.int32)  # index into `prompts` (sorted: code order = string order)
    ids = {column: np.empty(n, dtype) for column, dtype in ID_DTYPES.items()}
    matrix_t = np.empty((len(FEATURE_NAMES), n), np.float32)  # [F, n]: a column per feature
    value_set = pa.array(prompts, pa.string())
    filled = 0
    for path in parts:
        for batch in _batches(path, ["prompt_id", *ID_DTYPES, *FEATURE_NAMES], split=name):
            end = filled + batch.num_rows
            if end > n:
                raise DataError(f"{path}: the parts changed while being read")
            prompt = _codes(batch, "prompt_id", path)
            lookup = pc.index_in(prompt.dictionary, value_set, memory_pool=POOL)
            codes[filled:end] = lookup.to_numpy(zero_copy_only=False)[prompt.indices.to_numpy()]
            for column in ID_DTYPES:
                ids[column][filled:end] = _values(batch, column, path)
            for j, feature in enumerate(FEATURE_NAMES):
                matrix_t[j, filled:end] = _values(batch, feature, path)
            filled = end
    if filled != n:
        raise DataError(f"{folder}/parts: the parts changed while being read")
    _sort(codes, ids, matrix_t)
    keep, dropped = _finite_rounds(codes, ids, matrix_t, label, temperature)
    if keep is not None:
        codes, ids, matrix_t = _compact(codes, ids, matrix_t, keep)
    if not len(codes):
        raise DataError(f"{folder}: no usable rows of split '{name}' at temperature "
                        f"{temperature:g}")
    matrix = matrix_t.T  # [n, F], Fortran-ordered: what the DataFrame's float block holds
    rows = pd.concat([pd.DataFrame({
        "prompt_id": pd.Categorical.from_codes(codes, categories=pd.Index(prompts, dtype=str)),
        "split": pd.Categorical.from_codes(np.zeros(len(codes), np.int8), categories=[name]),
        **ids}, copy=False), pd.DataFrame(matrix, columns=FEATURE_NAMES, copy=False)], axis=1)
    if name == "train":
        y = ids["label"][ids["label"] >= 0] == 1 if label == "hard" else ids["soft_label"]
        _check_classes(y.astype(np.float32), label, folder)
    return Split(name, rows, matrix), dropped


def _check_classes(y: np.ndarray, label: str, folder: Path) -> None:
    """DataError unless the train split's training labels hold both classes."""
    if y.size == 0 or y.min() == y.max():
        kind = ("no labelled rows" if y.size == 0
                else f"one class only (every {label} label is {y.min():g})")
        raise DataError(f"{folder}: split 'train' has {kind}; cannot train a decision model")


def _codes(batch: pa.RecordBatch, column: str, path: Path) -> pa.DictionaryArray:
    """A string column of a batch as (indices, dictionary); DataError on a null."""
    array = batch.column(column)
    if array.null_count:
        raise DataError(f"{path}: rows without a {column}")
    return array if pa.types.is_dictionary(array.type) else array.dictionary_encode()


def _values(batch: pa.RecordBatch, column: str, path: Path) -> np.ndarray:
    """A column of a batch as numpy (nulls: NaN in float columns, an error elsewhere)."""
    array = batch.column(column)
    if array.null_count and not pa.types.is_floating(array.type):
        raise DataError(f"{path}: null values in column '{column}'")
    return array.to_numpy(zero_copy_only=False)


def _sort(codes: np.ndarray, ids: dict[str, np.ndarray], matrix_t: np.ndarray) -> None:
    """In place, stably by (prompt, round, node), one column at a time (a column of scratch)."""
    order = np.lexsort((ids["node"], ids["round"], codes))
    codes[:] = codes[order]
    for values in ids.values():
        values[:] = values[order]
    for row in matrix_t:
        row[:] = row[order]


def _finite_rounds(codes: np.ndarray, ids: dict[str, np.ndarray], matrix_t: np.ndarray,
                   label: str, temperature: float) -> tuple[np.ndarray | None, int]:
    """(rows to keep, or None for all; rounds dropped): the rows at `temperature`, less any
    round with a non-finite feature (or soft label, for soft labels), which goes whole."""
    other = ids["temperature"] != np.float32(temperature)
    bad = np.zeros(len(codes), bool)
    for row in matrix_t:
        bad |= ~np.isfinite(row)
    if label == "soft":
        bad |= ~np.isfinite(ids["soft_label"])
    bad &= ~other
    if not bad.any():
        return (~other if other.any() else None), 0
    keys = codes.astype(np.int64) * (int(ids["round"].max()) + 1) + ids["round"]
    bad_rounds = np.unique(keys[bad])
    return ~other & ~np.isin(keys, bad_rounds), len(bad_rounds)


def _compact(codes: np.ndarray, ids: dict[str, np.ndarray], matrix_t: np.ndarray,
             keep: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """The kept rows, in the front of the matrix's own buffer (no second copy of it): row j of
    [F, m] goes to flat offset j * m <= j * n, after rows < j moved, before its own is read."""
    m, n = int(keep.sum()), matrix_t.shape[1]
    flat = matrix_t.reshape(-1)
    for j in range(matrix_t.shape[0]):
        flat[j * m:(j + 1) * m] = flat[j * n:(j + 1) * n][keep]
    return (codes[keep], {column: values[keep] for column, values in ids.items()},
            flat[:matrix_t.shape[0] * m].reshape(-1, m))
