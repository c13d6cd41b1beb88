"""Atomic file writes: a temp file in the same folder, then a rename, so readers and resumed
runs never see a partial file."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Callable


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


def write_json(path: Path, value: object) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value, indent=2) + "\n"))
