"""Sizes that follow the machine (`specstop.pipeline.sizes`): the size-bound counts scaled by
the target's measured step, the first part of the same prompts, never below the floor."""

from __future__ import annotations

import pytest

from specstop.common.errors import SpecstopError
from specstop.common.params import validate
from specstop.decoder.costs import VerifyCosts
from specstop.pipeline.sizes import SCALED, sized


def params_on(tmp_path, step_ms: float | None, sizes: dict | None = None, **sections):
    """Params whose costs file (absent where step_ms is None) measured a step of step_ms."""
    path = tmp_path / "verify.json"
    if step_ms is not None:
        VerifyCosts("target", "float32", "cpu", 200,
                    {1: step_ms / 1000, 2: step_ms / 900}).save(path)
    return validate({"costs": {"path": str(path)},
                     "sizes": sizes or {"full_until_step_ms": 24}, **sections})


COUNTS = {"draft": {"max_prompts": 320}, "collect": {"max_prompts": 24, "overhead_prompts": 8},
          "export": {"settle": {"prompts": 48, "margin": 0.2}}, "bench": {"prompts": 24}}


def test_a_machine_within_the_step_runs_the_counts_as_written(tmp_path):
    params = params_on(tmp_path, 15.6, **COUNTS)
    for stage in SCALED:
        same, record = sized(stage, params)
        assert same == params and record["scale"] == 1 and record["step_ms"] == 15.6


def test_a_slower_machine_scales_every_count_of_the_stage_by_the_ratio(tmp_path, capsys):
    params = params_on(tmp_path, 48.0, **COUNTS)  # x0.5
    draft, _ = sized("draft", params)
    collect, record = sized("collect", params)
    export, _ = sized("export", params)
    bench, _ = sized("bench", params)
    assert record == {"scale": 0.5, "step_ms": 48.0, "counts": {"collect.max_prompts": 12}}
    assert (draft.draft.max_prompts, export.export.settle.prompts, bench.bench.prompts) \
        == (160, 24, 12)
    assert (collect.collect.max_depth, collect.collect.overhead_prompts) == (
        params.collect.max_depth, 8)  # the rest as written: the round overhead's prompts too
    assert export.export.settle.margin == 0.2  # a nested section's too
    assert bench.collect.max_prompts == 24  # a stage scales its own counts only
    assert "counts x0.5 (collect.max_prompts 24 -> 12)" in capsys.readouterr().out


def test_the_scale_has_a_floor_and_every_count_keeps_one_prompt(tmp_path):
    params = params_on(tmp_path, 2400.0, {"full_until_step_ms": 24, "min_scale": 0.1},
                       bench={"prompts": 5}, draft={"max_prompts": None})
    bench, record = sized("bench", params)
    assert record["scale"] == 0.1 and bench.bench.prompts == 1
    draft, record = sized("draft", params)
    assert draft.draft.max_prompts is None  # all: nothing to scale


def test_null_or_a_stage_without_counts_reads_no_costs_file(tmp_path):
    off = params_on(tmp_path, None, {"full_until_step_ms": None})
    assert sized("bench", off) == (off, None)
    on = params_on(tmp_path, None)
    assert sized("train", on) == (on, None) and sized("prepare", on) == (on, None)


def test_a_missing_costs_file_is_one_error_naming_it_and_the_way_out(tmp_path):
    with pytest.raises(SpecstopError, match=r"verify\.json: cannot read .*specstop prepare.*"
                                            r"sizes\.full_until_step_ms: null"):
        sized("collect", params_on(tmp_path, None))
