"""Logged rows as training and replay data: features, labels, splits by prompt, NaN handling.

A split is the `split` column written by stage `collect` (prompts were assigned to splits in
stage `prompts`, so no prompt is in two splits: that is checked).  Training rows are the labelled
rows (`label >= 0`) for hard labels and every row for soft labels (min(1, p/q) is the
acceptance probability given the branch so far, defined after a rejection too).  A round with
any non-finite feature (or soft label) is dropped whole, from training and from the replay, and
counted; the count is logged.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from specstop.features import FEATURES, SCHEMA_VERSION
from specstop.features.dataset import DataError, read_parts

FEATURE_NAMES = [f.name for f in FEATURES]
LABEL_TYPES = ("hard", "soft")
ROUND_KEYS = ["prompt_id", "round"]
COLUMNS = ["prompt_id", "split", "round", "node", "parent", "label", "soft_label",
           *FEATURE_NAMES]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """The rows of one split, ordered by (prompt, round, node): level-major within a round."""

    name: str
    rows: pd.DataFrame

    @property
    def features(self) -> np.ndarray:  # [n, F] float32, every row
        return self.rows[FEATURE_NAMES].to_numpy(np.float32)

    def examples(self, label: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(X [m, F], y [m] in [0, 1], prompt group [m]) of the training rows for a label type."""
        rows = self.rows[self.rows["label"] >= 0] if label == "hard" else self.rows
        y = (rows["label"] == 1) if label == "hard" else rows["soft_label"]
        return (rows[FEATURE_NAMES].to_numpy(np.float32), y.to_numpy(np.float32),
                rows["prompt_id"].to_numpy())

    def labelled(self) -> tuple[np.ndarray, np.ndarray]:
        """(X, hard label) of the labelled rows: what the greedy runtime's truth scores."""
        rows = self.rows[self.rows["label"] >= 0]
        return rows[FEATURE_NAMES].to_numpy(np.float32), rows["label"].to_numpy(np.int8)


@dataclass(frozen=True)
class Dataset:
    train: Split
    val: Split
    digest: str
    schema_version: int
    dropped_rounds: int


def load(folder: Path, label: str = "hard") -> Dataset:
    """Read, validate and split `folder/parts`; DataError names the folder and the problem."""
    if label not in LABEL_TYPES:
        raise DataError(f"train.label must be one of {LABEL_TYPES}, got '{label}'")
    folder = Path(folder)
    table = read_parts(folder)
    if table.num_rows == 0:
        raise DataError(f"{folder}/parts: the parts hold no rows")
    rows = table.select(COLUMNS).to_pandas()
    rows, dropped = _drop_nonfinite_rounds(rows, label)
    if dropped:
        log.warning("%s: dropped %d round(s) with non-finite features or labels", folder, dropped)
    _check_disjoint(rows, folder)
    splits = {name: _split(rows, name, folder, label) for name in ("train", "val")}
    return Dataset(splits["train"], splits["val"], digest(folder), SCHEMA_VERSION, dropped)


def digest(folder: Path) -> str:
    """sha256 over the part files (names and bytes) and the cost model."""
    h = hashlib.sha256()
    files = sorted((Path(folder) / "parts").glob("*.parquet")) + [Path(folder) / "costs.json"]
    for path in files:
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _drop_nonfinite_rounds(rows: pd.DataFrame, label: str) -> tuple[pd.DataFrame, int]:
    checked = FEATURE_NAMES + (["soft_label"] if label == "soft" else [])
    bad = ~np.isfinite(rows[checked].to_numpy(np.float64)).all(axis=1)
    if not bad.any():
        return rows, 0
    bad_rounds = rows.loc[bad, ROUND_KEYS].drop_duplicates()
    marked = rows.merge(bad_rounds.assign(_bad=True), on=ROUND_KEYS, how="left")
    kept = rows[marked["_bad"].isna().to_numpy()]
    return kept, len(bad_rounds)


def _check_disjoint(rows: pd.DataFrame, folder: Path) -> None:
    splits_per_prompt = rows.groupby("prompt_id")["split"].nunique()
    shared = splits_per_prompt[splits_per_prompt > 1]
    if len(shared):
        raise DataError(f"{folder}: prompt '{shared.index[0]}' is in more than one split "
                        f"({len(shared)} such prompts); splits must be by prompt")


def _split(rows: pd.DataFrame, name: str, folder: Path, label: str) -> Split:
    part = rows[rows["split"] == name].sort_values(ROUND_KEYS + ["node"], kind="stable")
    if part.empty:
        raise DataError(f"{folder}: no usable rows of split '{name}'")
    split = Split(name, part.reset_index(drop=True))
    _, y, _ = split.examples(label)
    if name == "train" and (y.size == 0 or y.min() == y.max()):
        kind = "no labelled rows" if y.size == 0 else f"one class only (every {label} label is {y.min():g})"
        raise DataError(f"{folder}: split 'train' has {kind}; cannot train a decision model")
    return split
