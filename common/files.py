"""Atomic file writes: a temp file in the same folder, then a rename, so readers and resumed
runs never see a partial file; a killed writer's temp file is removed when its run resumes.
Work made with other settings is set aside (moved under a `stale/` folder), never deleted.
Also the checks before a stage's work: an input that must be a file, an output that must be
writable, and a lock on an output folder that one run at a time writes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .errors import SpecstopError

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


RECIPE_FILE = "recipe.json"


def resume_or_set_aside(folder: Path, recipe: dict, stale_root: Path, what: str) -> bool:
    """True when `folder` holds work done with `recipe` (`folder/recipe.json`): resume it.

    Otherwise whatever `folder` holds is moved, never deleted, to `stale_root/<folder name>-<old
    recipe digest>/`, and work set aside earlier with `recipe` is moved back (True), or else
    `folder` starts afresh with `recipe` recorded (False); a message says what moved where.
    Call it only after the settings and models were checked, so a typo moves nothing."""
    folder, stale_root = Path(folder), Path(stale_root)
    if _recipe_of(folder) == _canonical(recipe):
        return True
    if folder.is_dir() and any(p.name != RECIPE_FILE for p in folder.iterdir()):
        dest = _free_name(stale_root, f"{folder.name}-{_digest(_recipe_of(folder))}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder, dest)
        print(f"{what}: made with other settings; moved to {dest}", file=sys.stderr)
    earlier = [p for p in sorted(stale_root.glob(f"{folder.name}-*"))
               if _recipe_of(p) == _canonical(recipe)]
    if earlier:
        shutil.rmtree(folder, ignore_errors=True)  # at most a recipe file is left there
        os.replace(earlier[-1], folder)
        print(f"{what}: resuming the work made with these settings, moved back from "
              f"{earlier[-1]}", file=sys.stderr)
        return True
    write_json(folder / RECIPE_FILE, recipe)
    return False


def _canonical(recipe: dict) -> dict:
    return json.loads(json.dumps(recipe))


def _recipe_of(folder: Path) -> dict | None:
    path = folder / RECIPE_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None  # a damaged recipe matches nothing: its folder is set aside


def _digest(recipe: dict | None) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _free_name(root: Path, name: str) -> Path:
    """`root/name`, or `root/name-2`, `-3`, ... when it is taken."""
    dest, n = root / name, 1
    while dest.exists():
        n += 1
        dest = root / f"{name}-{n}"
    return dest


def require(path: Path, stage: str) -> Path:
    """`path`, which stage `stage` writes; a one-line error naming both when it is missing."""
    if not Path(path).exists():
        raise SpecstopError(f"{path}: not found (run `specstop {stage}` or `dvc repro {stage}` "
                            f"first)")
    return Path(path)


def check_file(path: Path, missing: str) -> Path:
    """`path` where it is a file; the error `missing` where it is absent, and one saying so
    where it is a directory."""
    path = Path(path)
    if path.is_dir():
        raise SpecstopError(f"{path}: is a directory, not a file")
    if not path.is_file():
        raise SpecstopError(missing)
    return path


def read_json(path: Path, stage: str) -> dict:
    """The JSON object in `path`, which stage `stage` writes; one line where it is missing, a
    directory, not JSON or not an object."""
    check_file(require(path, stage), f"{path}: not found")
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON or UTF-8
        raise SpecstopError(f"{path}: not valid JSON ({err}); re-run `specstop {stage}`") from err
    if not isinstance(value, dict):
        raise SpecstopError(f"{path}: not a JSON object; re-run `specstop {stage}`")
    return value


def check_writable(path: Path, key: str, folder: bool = False) -> None:
    """Refuse, before any work, an output `path` (a file, or a folder with `folder`) that cannot
    be written: a directory where a file goes, a file where a folder goes, or a nearest existing
    folder that takes no new file.  `key` names the setting that chose the path."""
    path = Path(path)
    if path.is_dir() != folder and path.exists():
        kind = "a directory, not a file" if path.is_dir() else "a file, not a folder"
        raise SpecstopError(f"{path}: is {kind} ({key})")
    existing = path if folder else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SpecstopError(f"{path}: cannot be created, {existing} is a file ({key})")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise SpecstopError(f"{path}: cannot be written, {existing} takes no new file "
                            f"({err.strerror or err}; {key})") from err


LOCK_FILE = ".lock"  # in an output folder while a run writes it


@contextmanager
def folder_lock(folder: Path, stage: str) -> Iterator[None]:
    """Hold `folder/.lock` for the block, so that a second run writing `folder` (another shell,
    another torchrun) fails at once, naming the folder, instead of writing beside this one."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise SpecstopError(f"{folder}: another `specstop {stage}` run is writing this folder "
                            f"(wait for it to end, or stop it)") from None
    try:
        yield
    finally:
        lock.release()
