"""Logged draft steps: the row schema, the decode-loop hook that makes rows, Parquet parts.

One row per drafted token: ids (the round's `temperature` among them), the feature vector
(`specstop.features.FEATURES`, which holds the depth), labels.  `label` is the hard label (1
accepted, 0 rejected) given that every earlier token of its branch was accepted; tokens after
the first rejection of their branch keep their row with `label = -1` and `after_rejection = True`
(they count wasted draft steps in the simulator) but are not training examples.  `soft_label`
is min(1, p/q), `accept_prob` the exact chance the token is accepted at its parent given that
the parent was and its earlier siblings were not (`decoder.verify.acceptance`; every row, under
greedy decoding the hard label where there is one).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from specstop.common.errors import DataError, first_line
from specstop.common.files import write_atomic, write_json
from specstop.features import FEATURES, SCHEMA_VERSION, schema_dict

if TYPE_CHECKING:  # the loop's record type only: reading rows needs no runtime
    from specstop.decoder.loop import RoundRecord

T = TypeVar("T")

ID_COLUMNS = [
    ("prompt_id", pa.string()),
    ("split", pa.string()),
    ("temperature", pa.float32()),  # the round's sampling temperature (0: greedy)
    ("round", pa.int32()),
    ("node", pa.int16()),
    ("parent", pa.int16()),
    ("branch", pa.int16()),
    ("token", pa.int32()),
]
LABEL_COLUMNS = [
    ("label", pa.int8()),
    ("after_rejection", pa.bool_()),
    ("soft_label", pa.float32()),
    ("accept_prob", pa.float32()),
    ("p_target", pa.float32()),
    ("q_draft", pa.float32()),
]
ROW_SCHEMA = pa.schema(ID_COLUMNS + [(f.name, pa.float32()) for f in FEATURES] + LABEL_COLUMNS,
                       metadata={"feature_schema_version": str(SCHEMA_VERSION)})


class RoundLogger:
    """Decode-loop hook that accumulates rows for one prompt at a time (columnar)."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {name: [] for name in ROW_SCHEMA.names}
        self.prompt_id, self.split, self.temperature = "", "", 0.0

    def start(self, prompt_id: str, split: str, temperature: float = 0.0) -> None:
        self.prompt_id, self.split, self.temperature = prompt_id, split, temperature

    def __call__(self, record: RoundRecord) -> None:
        n = record.tokens.shape[0]
        c = self.columns
        c["prompt_id"] += [self.prompt_id] * n
        c["split"] += [self.split] * n
        c["temperature"] += [self.temperature] * n
        c["round"] += [record.round] * n
        for name, values in [("node", record.node), ("parent", record.parent),
                             ("branch", record.branch),
                             ("token", record.tokens), ("label", record.labels)]:
            c[name] += values.tolist()
        features = record.features.numpy()
        for j, feature in enumerate(FEATURES):
            c[feature.name] += features[:, j].tolist()
        c["after_rejection"] += (record.labels < 0).tolist()
        ratio = record.p_target / record.q_draft.clamp_min(1e-30)
        c["soft_label"] += torch.clamp(ratio, max=1.0).tolist()
        c["accept_prob"] += record.accept_prob.tolist()
        c["p_target"] += record.p_target.tolist()
        c["q_draft"] += record.q_draft.tolist()

    def __len__(self) -> int:
        return len(self.columns["label"])

    def table(self) -> pa.Table:
        return pa.table(self.columns, schema=ROW_SCHEMA)


def write_part(table: pa.Table, path: Path) -> None:
    """Write one Parquet part atomically (temp file in the same folder, then rename)."""
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))


def write_schema(folder: Path) -> None:
    """Save the feature schema beside the data."""
    write_json(folder / "schema.json", schema_dict())


def read_part(path: Path) -> pa.Table:
    """One part, validated against ROW_SCHEMA; DataError names the file and the problem."""
    table = _decoded(path, pq.read_table)
    check_columns(path, table.schema)
    return table


def check_part(path: Path) -> None:
    """One part's footer validated against ROW_SCHEMA, no data read: the cheap check before a
    streaming read; DataError names the file and the problem."""
    check_columns(path, _decoded(path, pq.read_schema))


def _decoded(path: Path, read: Callable[[Path], T]) -> T:
    """`read(path)`, with a missing or undecodable file as a DataError naming it."""
    try:
        return read(path)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found")
    except (pa.ArrowException, OSError) as err:
        raise corrupt(path, err) from err


def corrupt(path: Path, err: Exception) -> DataError:
    """The DataError of a part that cannot be decoded (one line)."""
    return DataError(f"{path}: corrupt or truncated Parquet file ({first_line(err)})")


def check_columns(path: Path, schema: pa.Schema) -> None:
    """DataError unless `schema` (with its metadata) is ROW_SCHEMA's."""
    version = (schema.metadata or {}).get(b"feature_schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise DataError(f"{path}: feature schema version {version}, expected {SCHEMA_VERSION}")
    if schema.remove_metadata() != ROW_SCHEMA.remove_metadata():
        missing = set(ROW_SCHEMA.names) - set(schema.names)
        raise DataError(f"{path}: columns differ from the row schema"
                        + (f" (missing {sorted(missing)})" if missing else ""))


def read_parts(folder: Path) -> pa.Table:
    """Every part under `folder/parts`, validated, concatenated in part-name order."""
    parts = sorted((Path(folder) / "parts").glob("*.parquet"))
    if not parts:
        raise DataError(f"{folder}: no logged parts (run `specstop collect` first)")
    return pa.concat_tables([read_part(p) for p in parts])
