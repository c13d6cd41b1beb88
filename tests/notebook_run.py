"""Execute notebooks/analysis.ipynb against a project's pipeline outputs (a helper, not a test).

    from notebook_run import figures, run_notebook
    nb = run_notebook(project)          # raises nbclient's CellExecutionError on a failing cell
    assert figures(nb) >= 5
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def run_notebook(project: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """The analysis notebook executed (kernel python3) with `project` as its working directory
    and SPECSTOP_PROJECT; `timeout` seconds per cell.  The stored notebook is not modified."""
    project = Path(project).resolve()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(project)}})
    env = {**os.environ, "SPECSTOP_PROJECT": str(project)}
    return client.execute(env=env)


def figures(nb: nbformat.NotebookNode) -> int:
    """How many image outputs the executed notebook holds (one per displayed figure)."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code"
               for output in cell.get("outputs", [])
               if any(kind in output.get("data", {}) for kind in IMAGE_TYPES))
