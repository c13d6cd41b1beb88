"""Small synthetic `collect` folders (ROW_SCHEMA parts + costs.json) for the train-stage tests:
a ti-mcsd-like tree (one root, W candidates at level 1, chains below), greedy labels whose
acceptance is q_token ** 2, q_token drawn around a per-branch ease (easy spans stay easy, as
with real drafts), so the token just drafted tells about the next one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from specstop.features import FEATURES
from specstop.collection.rows import ROW_SCHEMA, write_part, write_schema

COSTS = {"tree_sizes": None, "threads": 1,
         "target": {"seconds": None}, "draft": {"seconds": {"1": 0.002, "3": 0.0021}},
         "c": 0.05, "decision_seconds": 1e-5}


def round_rows(prompt_id: str, split: str, index: int, width: int, depth: int,
               rng: np.random.Generator, temperature: float = 0.0) -> dict[str, list]:
    """Rows of one round: at most one candidate accepted per level; sampled (temperature > 0),
    each test's chance is its soft label."""
    rows: dict[str, list] = {name: [] for name in ROW_SCHEMA.names}
    alive = 0  # the branch still accepted (level 1: every candidate is compared)
    ease = rng.uniform(0.05, 1.0, size=width)
    for level in range(1, depth + 1):
        accepted = -1
        for b in range(width):
            node = (level - 1) * width + b + 1
            q = float(np.clip(ease[b] + rng.normal(0, 0.1), 0.05, 1.0))
            labelled = level == 1 or b == alive
            label = int(accepted < 0 and rng.uniform() < q ** 2) if labelled else -1
            if label == 1:
                accepted = b
            features = {f.name: float(rng.uniform()) for f in FEATURES}
            features.update(q_token=q, q_top1=q, q_entropy=float(-np.log(q)), depth=float(level),
                            sibling_rank=float(b if level == 1 else 0))
            soft = min(1.0, q ** 2 + float(rng.uniform(0, 0.05)))
            values = {"prompt_id": prompt_id, "split": split, "temperature": temperature,
                      "round": index, "node": node,
                      "parent": 0 if level == 1 else node - width, "branch": b,
                      "token": int(rng.integers(100)), **features, "label": label,
                      "after_rejection": label < 0, "soft_label": soft,
                      "accept_prob": soft if temperature > 0 else float(label == 1),
                      "p_target": soft * q, "q_draft": q}
            for name in ROW_SCHEMA.names:
                rows[name].append(values[name])
        alive = accepted
    return rows


def make_collect(folder: Path, prompts: dict[str, int] | None = None, rounds: int = 12,
                 width: int = 3, depth: int = 4, seed: int = 0,
                 temperatures: tuple[float, ...] = (0.0,)) -> Path:
    """A collect folder with one part per split and temperature and a cost model for the
    tree."""
    rng = np.random.default_rng(seed)
    prompts = prompts or {"train": 16, "val": 6}
    for split, count in prompts.items():
        for t in temperatures:
            rows: dict[str, list] = {name: [] for name in ROW_SCHEMA.names}
            for p in range(count):
                for r in range(rounds):
                    for name, values in round_rows(f"{split}-{p}", split, r, width, depth,
                                                   rng, t).items():
                        rows[name] += values
            name = f"{split}-00000" + (f"-T{t:g}" if t else "")
            write_part(pa.table(rows, schema=ROW_SCHEMA), folder / "parts" / f"{name}.parquet")
    write_schema(folder)
    sizes = [1 + width * d for d in range(depth + 1)]
    costs = json.loads(json.dumps(COSTS))
    costs["tree_sizes"] = sizes
    costs["target"]["seconds"] = {str(n): 0.04 + 0.0002 * n for n in sorted({1, *sizes})}
    (folder / "costs.json").write_text(json.dumps(costs))
    return folder
