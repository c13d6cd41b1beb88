"""MLflow: one experiment per pipeline, one run per model family (nested runs for a search),
plus one run for the baselines and the oracle."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Iterator

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

DEFAULT_URI = "sqlite:///mlflow.db"


def tracking_uri(configured: str | None) -> str:
    """MLFLOW_TRACKING_URI if set, else the params' `train.tracking_uri`, else the SQLite file."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or DEFAULT_URI


def start(uri: str, experiment: str) -> None:
    """Point MLflow at `uri` and select (creating if needed) the pipeline's experiment."""
    import mlflow

    logging.getLogger("alembic").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)


@contextmanager
def run(name: str, nested: bool = False) -> Iterator[str]:
    """A run named `name`; yields its id."""
    import mlflow

    with mlflow.start_run(run_name=name, nested=nested) as active:
        yield active.info.run_id


def log(params: dict | None = None, metrics: dict | None = None,
        tags: dict | None = None) -> None:
    """Params (stringified), finite numeric metrics, tags of the active run."""
    import mlflow

    if params:
        mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})
    if metrics:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()
                            if isinstance(v, (int, float)) and v == v})
    if tags:
        mlflow.set_tags(tags)


def log_figure(fig: Figure, name: str) -> None:
    import mlflow

    mlflow.log_figure(fig, name)
    plt.close(fig)


def log_dict(value: dict, name: str) -> None:
    import mlflow

    mlflow.log_dict(value, name)
