"""Read params.yaml (every knob of the pipeline) with clear errors."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from specstop.common.errors import SpecstopError

DEFAULT_PARAMS = Path("params.yaml")
Config = TypeVar("Config")


def load_params(path: Path = DEFAULT_PARAMS, required: bool = False) -> dict[str, Any]:
    """The parsed params file; {} when it is absent and not required."""
    path = Path(path)
    if not path.is_file():
        if required:
            raise SpecstopError(f"params file not found: {path}")
        return {}
    try:
        params = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SpecstopError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(params, dict):
        raise SpecstopError(f"{path}: expected a mapping at the top level")
    for name, value in params.items():
        if not isinstance(value, dict):
            raise SpecstopError(f"{path}: '{name}' must be a mapping")
    return params


def section(params: dict[str, Any], name: str) -> dict[str, Any]:
    """One section of the params (checked to be a mapping by load_params)."""
    return params.get(name, {})


def mlflow_settings(params: dict[str, Any], stage: str) -> dict[str, str]:
    """The shared `mlflow` section as one stage's `tracking_uri` and experiment `<name>-<stage>`
    (only the keys the section sets)."""
    mlflow = section(params, "mlflow")
    out = {}
    if "tracking_uri" in mlflow:
        out["tracking_uri"] = str(mlflow["tracking_uri"])
    if "experiment" in mlflow:
        out["experiment"] = f"{mlflow['experiment']}-{stage}"
    return out


def config_from(cls: type[Config], values: dict[str, Any], name: str) -> Config:
    """A stage's config dataclass from its params section: an unknown key is an error naming
    the section; fields typed `Path` get Paths."""
    known = {f.name: f for f in fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise SpecstopError(f"params.yaml: unknown key(s) in '{name}': {sorted(unknown)}")
    return cls(**{k: Path(v) if known[k].type in (Path, "Path") else v
                  for k, v in values.items()})
