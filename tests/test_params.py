"""The params schema (`specstop.common.params`): this project's params.yaml passes it, its names
agree with the code's registries, and CLI flags are checked and named as flags."""

from __future__ import annotations

from typing import get_args

import pytest
import yaml

from specstop.common.errors import SpecstopError
from specstop.common.params import (METHODS, STOP_FAMILIES, Method, StopTrainConfig, validate,
                                    with_overrides)
from specstop.models.families import FITTERS

from conftest import ROOT


def test_the_project_params_and_profiles_pass():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = validate(raw)
    assert params.draft.train.precision == "auto" and "smoke" in params.profiles
    assert params.train.lightgbm.min_child_samples == raw["train"]["lightgbm"]["min_child_samples"]


def test_the_schema_names_what_the_code_registers():
    assert get_args(Method) == METHODS
    assert STOP_FAMILIES == tuple(FITTERS)
    families = StopTrainConfig.model_fields["families"].annotation
    assert get_args(get_args(families)[0]) == STOP_FAMILIES


def test_flags_are_checked_and_named_as_flags():
    params = validate({"decode": {"gamma": 3}})
    assert with_overrides(params, "p.yaml", decode={"max_new_tokens": 8}).decode.gamma == 3
    with pytest.raises(SpecstopError, match=r"^--top-p: expected a number > 0 and <= 1, got 2"):
        with_overrides(params, "p.yaml", decode={"top_p": 2.0})
    with pytest.raises(SpecstopError, match=r"^--dtype: expected one of 'auto'"):
        with_overrides(params, "p.yaml", models={"dtype": "fp8"})


def test_overrides_merge_nested_sections_key_by_key():
    params = validate({"export": {"settle": {"margin": 0.2, "prompts": 30}}})
    settle = with_overrides(params, "p.yaml", export={"settle": {"prompts": 8}}).export.settle
    assert (settle.prompts, settle.margin) == (8, 0.2)
    with pytest.raises(SpecstopError,
                       match=r"^p.yaml: export.settle.prompts: expected an integer >= 1"):
        with_overrides(params, "p.yaml", export={"settle": {"prompts": 0}})


def test_sections_are_frozen_and_unknown_keys_name_the_known_ones():
    params = validate({})
    with pytest.raises(Exception):
        params.train.seed = 3  # a stage cannot change what the file said
    with pytest.raises(SpecstopError, match=r"p\.yaml: bench\.promtps: unknown key \(known: "
                                            r"assistant_draft, bootstrap_resamples, draft_metrics, export"):
        validate({"bench": {"promtps": 3}}, "p.yaml")
