"""MLflow: one experiment per stage (`<experiment>-<stage>`, tagged as model training so the UI
opens on its runs), one run per model family (nested runs for a search), plus one run for the
baselines and the oracle, each with its datasets; one run per bench."""

from __future__ import annotations

import json
import logging
import os
import ssl
import tempfile
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .errors import SpecstopError, first_line
from .params import DEFAULT_TRACKING_URI

PROBE_TIMEOUT_S = 3.0  # a tracking server that does not answer /health within this is down
FIX = "fix `mlflow.tracking_uri` in params.yaml (or MLFLOW_TRACKING_URI, which overrides it)"
SCHEMES = ("", "file", "sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks",
           "databricks-uc", "uc")  # the tracking-store schemes MLflow knows
DATABASES = ("postgresql", "mysql", "mssql")  # SQLAlchemy stores: a driver module each
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3 refuses folder stores without it
SQLITE_HEADER = b"SQLite format 3\x00"
EXPERIMENT_KIND = "mlflow.experimentKind"  # the tag MLflow 3's UI reads (no Python constant)
MODEL_TRAINING = "custom_model_development"  # its "Machine learning" kind: the runs, not traces
MLFLOW_DIGEST_CHARS = 36  # the longest dataset digest an MLflow store keeps


def tracking_uri(configured: str | None) -> str:
    """MLFLOW_TRACKING_URI if set, else the params' `train.tracking_uri`, else the SQLite file."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or DEFAULT_TRACKING_URI


def start(uri: str, experiment: str) -> None:
    """Point MLflow at `uri` and select (creating if needed) the pipeline's experiment; a store
    MLflow refuses is a one-line SpecstopError naming the URI.  Call `check(uri)` first, before
    the stage's work: it catches the stores MLflow would retry for minutes."""
    import mlflow
    from sqlalchemy.exc import SQLAlchemyError

    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        mlflow.set_tracking_uri(uri)
        mark_model_training(uri, mlflow.set_experiment(experiment).experiment_id)
    except (mlflow.exceptions.MlflowException, SQLAlchemyError, OSError) as err:
        raise SpecstopError(f"MLflow tracking store {uri}: {first_line(err)}; {FIX}") from err


def mark_model_training(uri: str, experiment_id: str) -> None:
    """Tag the experiment as model training, so that MLflow 3's UI opens it on its runs rather
    than on the GenAI traces; a kind already set (in the UI, say) is left as it is."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    if EXPERIMENT_KIND not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)


def check(uri: str) -> None:
    """Fail fast where MLflow would retry for minutes, or fail late or with a traceback: a
    tracking server that does not answer (http, https), an SQLite file whose folder cannot be
    created or written, an unknown scheme, a folder store (MLflow 3 refuses it unless
    MLFLOW_ALLOW_FILE_STORE is set), a database without its driver.  A missing SQLite folder
    that can be created is fine (MLflow creates it); a server that answers at all, even with
    an HTTP error, is left to MLflow."""
    scheme = urlsplit(uri).scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter: a local path
        scheme = ""
    if scheme in ("http", "https"):
        _probe_server(uri)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme.split("+")[0] not in SCHEMES:  # postgresql+psycopg2 is postgresql
        raise SpecstopError(f"MLflow tracking URI {uri}: unknown scheme '{scheme}' (use "
                            f"sqlite:///path/to/mlflow.db or http://host:port); {FIX}")
    elif scheme in ("", "file") and not _file_store_allowed():
        raise SpecstopError(f"MLflow tracking URI {uri}: MLflow refuses a folder store unless "
                            f"{ALLOW_FILE_STORE}=true (use sqlite:///path/to/mlflow.db); {FIX}")
    elif scheme.split("+")[0] in DATABASES:
        _check_driver(uri)


def _file_store_allowed() -> bool:
    return os.environ.get(ALLOW_FILE_STORE, "").lower() in ("true", "1")


def _check_driver(uri: str) -> None:
    """The database URI's SQLAlchemy driver is installed (MLflow would fail with an import
    error, not a message)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(uri).get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError, ArgumentError) as err:
        raise SpecstopError(f"MLflow tracking URI {uri}: its database driver is not installed "
                            f"({first_line(err)}); install it or {FIX}") from err


def _probe_server(uri: str) -> None:
    """GET <uri>/health (every `mlflow server` serves it) with a short timeout."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S):
            return
    except urllib.error.HTTPError:
        return  # something answers (a proxy, auth): MLflow's own call reports what
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLError):
            return  # TLS settings (MLFLOW_TRACKING_INSECURE_TLS, ...) are MLflow's business
        raise SpecstopError(f"MLflow tracking server {uri} is not reachable ({reason or err}); "
                            f"start it (`mlflow server --host HOST --port PORT`) or {FIX}") from err


def _check_sqlite(uri: str) -> None:
    """The database is an SQLite file (or absent) and its folder exists or can be created, and
    can be written: otherwise MLflow retries opening it for about two minutes."""
    path = uri.removeprefix("sqlite:///").split("?")[0] if uri.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        return
    db, folder = Path(path), Path(path).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecstopError(f"MLflow tracking store {uri}: cannot create the folder {folder} "
                            f"({err.strerror or first_line(err)}); create it or {FIX}") from err
    try:
        if db.is_dir():
            raise SpecstopError(f"MLflow tracking store {uri}: {db} is a folder, not an SQLite "
                                f"file; {FIX}")
        if db.exists():
            with open(db, "r+b") as file:  # opened for writing, nothing written
                head = file.read(len(SQLITE_HEADER))
            if head and head != SQLITE_HEADER:
                raise SpecstopError(f"MLflow tracking store {uri}: {db} is not an SQLite "
                                    f"database; {FIX}")
        else:
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise SpecstopError(f"MLflow tracking store {uri}: cannot write "
                            f"{db if db.exists() else folder} ({err.strerror or first_line(err)}); "
                            f"make it writable or {FIX}") from err


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


def log_dataset(name: str, digest: str, folder: Path, rows: int, context: str) -> None:
    """An input of the active run, as the runs table's Dataset column shows it: `name`, the
    data's `digest` (its first MLFLOW_DIGEST_CHARS), the folder as its local source, the row
    count as its profile.  Metadata only: no row is read."""
    import mlflow
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    dataset = Dataset(name=name, digest=digest[:MLFLOW_DIGEST_CHARS], source_type="local",
                      source=json.dumps({"uri": str(Path(folder).resolve())}),
                      profile=json.dumps({"num_rows": rows}))
    mlflow.MlflowClient().log_inputs(mlflow.active_run().info.run_id, datasets=[
        DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])])


def log_figure(fig: Figure, name: str) -> None:
    import mlflow

    mlflow.log_figure(fig, name)
    plt.close(fig)


def log_dict(value: dict, name: str) -> None:
    import mlflow

    mlflow.log_dict(value, name)
