"""Read params.yaml: parse it, check it against the schema (`specstop.common.params`) and the
prompt sources' rules, all before a stage does any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from specstop.common.errors import SpecstopError
from specstop.common.params import Params, validate

from specstop.prompts.sources import parse_sources
from specstop.prompts.splits import check_fractions

DEFAULT_PARAMS = Path("params.yaml")


def read_params_file(path: Path = DEFAULT_PARAMS, required: bool = False) -> dict[str, Any]:
    """The parsed params file as it is written; {} when it is absent and not required."""
    path = Path(path)
    if not path.is_file():
        if required:
            raise SpecstopError(f"params file not found: {path}")
        return {}
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise SpecstopError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(raw, dict):
        raise SpecstopError(f"{path}: expected a mapping at the top level")
    return raw


def checked_params(raw: dict[str, Any], path: Path = DEFAULT_PARAMS) -> Params:
    """The typed params: the schema, then the prompt sources and fractions."""
    params = validate(raw, str(path))
    try:
        parse_sources(params.prompts.sources)
        check_fractions(params.prompts.fractions)
    except SpecstopError as err:
        raise SpecstopError(f"{path}: {err}") from None
    return params


def load_params(path: Path = DEFAULT_PARAMS, required: bool = False) -> Params:
    """The typed params of a params file (the defaults when it is absent and not required)."""
    return checked_params(read_params_file(path, required), path)
