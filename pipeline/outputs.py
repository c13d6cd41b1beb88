"""What each stage writes, by the params key that names it, checked writable before the stage's
work (`check_outputs`): an unwritable data/ or metrics/ fails in a second, not after the work
with some outputs written and others not."""

from __future__ import annotations

from pathlib import Path

from specstop.common.files import check_writable
from specstop.common.params import Params
from specstop.common.paths import STAGE_METRICS


def stage_outputs(stage: str, params: Params) -> list[tuple[str, Path, bool]]:
    """(params key, path, is a folder) of everything `stage` writes, its stage record last."""
    p = params
    outputs = {
        "prepare": [("costs.path", p.costs.path, False)],
        "prompts": [("prompts.out", p.prompts.out, True)],
        "draft": [("draft.out", p.draft.out, True), ("draft.metrics", p.draft.metrics, False),
                  ("draft.plots", p.draft.plots, True)],
        "collect": [("collect.out", p.collect.out, True),
                    ("collect.summary", p.collect.summary, False)],
        "train": [("train.out", p.train.out, True), ("train.metrics", p.train.metrics, False),
                  ("train.plots", p.train.plots, True)],
        "export": [("export.out", p.export.out, True), ("export.metrics", p.export.metrics, False)],
        "bench": [("bench.metrics", p.bench.metrics, False), ("bench.plots", p.bench.plots, True)],
    }[stage]
    return outputs + [("the stage record", STAGE_METRICS / f"{stage}.json", False)]


def check_outputs(stage: str, params: Params) -> None:
    """Refuse (one line naming the path and its key) an output of `stage` that cannot be
    written, before any work."""
    for key, path, folder in stage_outputs(stage, params):
        check_writable(path, key, folder)
