"""Atomic file writes: a temp file in the same folder, then a rename, so readers and resumed
runs never see a partial file; a killed writer's temp file is removed when its run resumes."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Callable

TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")  # `write_atomic`'s temp files


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temp)` to a temp file beside `path`, then rename it over `path`; on failure the
    temp file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_temp_files(folder: Path) -> None:
    """Delete the temp files that killed `write_atomic` calls left under `folder`; call it only
    while nothing writes there (when a run starts or resumes)."""
    for path in Path(folder).rglob(".*.tmp"):
        if TEMP_NAME.fullmatch(path.name) and path.is_file():
            path.unlink()


def write_json(path: Path, value: object) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value, indent=2) + "\n"))
