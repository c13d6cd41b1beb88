"""Read params.yaml: parse it, check it against the schema (`specstop.common.params`) and the
prompt sources' rules, all before a stage does any work."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from specstop.common.errors import SpecstopError
from specstop.common.files import check_file
from specstop.common.params import Params, validate

from specstop.prompts.sources import parse_sources
from specstop.prompts.splits import check_fractions

DEFAULT_PARAMS = Path("params.yaml")


def read_params_file(path: Path = DEFAULT_PARAMS, required: bool = False) -> dict[str, Any]:
    """The parsed params file as it is written; {} when it is absent and not required.  A file
    with no settings, a key given twice or a YAML error (its line and column) is refused."""
    path = Path(path)
    if not path.exists() and not required:
        return {}
    check_file(path, f"params file not found: {path}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise SpecstopError(f"{path}: not valid YAML{_yaml_problem(err)}") from err
    if raw is None:
        raise SpecstopError(f"{path}: no settings (empty, or only comments); write some, or "
                            f"delete the file to run on the defaults")
    if not isinstance(raw, dict):
        raise SpecstopError(f"{path}: expected a mapping at the top level")
    return raw


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (the plain loader keeps
    the last silently); keys merged in with `<<` may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(err: Exception) -> str:
    """' at line L, column C (what is wrong)' of a YAML error, a tab named as such."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if "'\\t'" in problem:
        problem = "a tab; YAML indents with spaces"
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where} ({problem})"


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
