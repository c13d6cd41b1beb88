"""Logged draft steps: the row schema, the decode-loop hook that makes rows, Parquet parts.

One row per drafted token: ids (the round's `temperature` among them), the feature vector
(`specstop.features.FEATURES`, which holds the depth), labels.  `label` is the hard label (1
accepted, 0 rejected) given that every earlier token of its branch was accepted; tokens after
the first rejection of their branch keep their row with `label = -1` and `after_rejection = True`
(they count wasted draft steps in the simulator) but are not training examples.  `soft_label`
is min(1, p/q), `accept_prob` the exact chance the token is accepted at its parent given that
the parent was and its earlier siblings were not (`decoder.verify.acceptance`; every row, under
greedy decoding the hard label where there is one).

Greedy prompts also log the lookup chain below every token of the text (`LOOKUP_SCHEMA`, one
row per chain token, `lookup/<part>.parquet` beside the part): the chain a round whose root is
that token would propose (`emitted`: the tokens out once it is; `round`: the logged round whose
root it is, -1 for none), its features (`decoder.lookup.LOOKUP_FEATURES`) and its labels, read
off the text the prompt went on to (greedy decoding emits the target's arg-max whatever is
proposed, so token j of a chain is accepted iff it and the tokens before it are the text's; -1
after a rejection or past the text's end).  The rounds' chains are what a greedy `tree` round
with a lookup branch adds; every token's, what `lookup` alone meets walking the text.  Sampled
rounds verify their chain beside the drafted tree (`decoder.lookup.with_chain`) and log it
as it was tested, one row per token the tree holds, with `accept_after`: its chance of
acceptance at its parent given that the parent was and the first k of the parent's drafted
children were rejected before it, k = 0, 1, ... (`decoder.verify.chain_acceptance`; label -1,
`text_tokens` -1; greedy rows: an empty list).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from specstop.common.errors import DataError, first_line
from specstop.common.files import write_atomic, write_json
from specstop.decoder.lookup import LOOKUP_FEATURES, Lookup
from specstop.features import FEATURES, SCHEMA_VERSION, feature_index, schema_dict

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
LOOKUP_SCHEMA = pa.schema([("prompt_id", pa.string()), ("split", pa.string()),
                           ("temperature", pa.float32()), ("round", pa.int32()),
                           ("emitted", pa.int32()), ("text_tokens", pa.int32()),
                           ("token", pa.int32()), ("label", pa.int8()),
                           *[(name, pa.float32()) for name in LOOKUP_FEATURES],  # position
                           # (1 = below the root) among them
                           ("accept_after", pa.list_(pa.float32()))])
LOOKUP = "lookup"  # the lookup rows' folder, inside `parts/`
TOKENS_GENERATED = feature_index("tokens_generated")


class RoundLogger:
    """Decode-loop hook that accumulates rows for one prompt at a time (columnar)."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {name: [] for name in ROW_SCHEMA.names}
        self.lookup_columns: dict[str, list] = {name: [] for name in LOOKUP_SCHEMA.names}
        self.prompt_id, self.split, self.temperature = "", "", 0.0
        self.rounds: dict[int, int] = {}  # the prompt's rounds by the tokens emitted once
        # their root is

    def start(self, prompt_id: str, split: str, temperature: float = 0.0) -> None:
        self.prompt_id, self.split, self.temperature = prompt_id, split, temperature
        self.rounds = {}

    def __call__(self, record: RoundRecord) -> None:
        n = record.tokens.shape[0]
        c = self.columns
        self.rounds[int(record.features[0, TOKENS_GENERATED])] = record.round
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
        if record.chain_accept:
            self._log_chain(record)

    def _log_chain(self, record: RoundRecord) -> None:
        """A sampled round's chain, as far as its tree holds it, with each token's
        acceptances."""
        k, c = len(record.chain_accept), self.lookup_columns
        for name, value in [("prompt_id", self.prompt_id), ("split", self.split),
                            ("temperature", self.temperature), ("round", record.round),
                            ("emitted", int(record.features[0, TOKENS_GENERATED])),
                            ("text_tokens", -1), ("label", -1)]:
            c[name] += [value] * k
        c["token"] += record.chain.tokens[:k]
        for name, column in zip(LOOKUP_FEATURES, record.chain.features()[:k].T):
            c[name] += column.tolist()
        c["accept_after"] += [a.tolist() for a in record.chain_accept]

    def finish(self, prompt: list[int], text: list[int], chain_tokens: int, ngram: int) -> None:
        """Log the lookup chain below each token of the text of the prompt just decoded
        (greedy): `prompt` its tokens, `text` the tokens it went on to, chains of up to
        `chain_tokens` tokens matched on n-grams of up to `ngram` tokens."""
        lookup, c = Lookup(prompt, ngram), self.lookup_columns
        for emitted, root in enumerate(text, start=1):
            lookup.extend([root])  # the text up to the root
            match = lookup.match(chain_tokens)
            if not match.tokens:
                continue
            round_index = self.rounds.get(emitted, -1)
            k, truth = len(match.tokens), text[emitted : emitted + len(match.tokens)]
            labels, alive = [], True
            for j, token in enumerate(match.tokens):
                hit = alive and j < len(truth) and token == truth[j]
                labels.append(1 if hit else 0 if alive and j < len(truth) else -1)
                alive = hit
            c["prompt_id"] += [self.prompt_id] * k
            c["split"] += [self.split] * k
            c["temperature"] += [0.0] * k
            c["round"] += [round_index] * k
            c["emitted"] += [emitted] * k
            c["text_tokens"] += [len(text)] * k
            c["token"] += match.tokens
            c["label"] += labels
            for name, column in zip(LOOKUP_FEATURES, match.features().T):
                c[name] += column.tolist()
            c["accept_after"] += [[]] * k

    def __len__(self) -> int:
        return len(self.columns["label"])

    def table(self) -> pa.Table:
        return pa.table(self.columns, schema=ROW_SCHEMA)

    def lookup_table(self) -> pa.Table:
        return pa.table(self.lookup_columns, schema=LOOKUP_SCHEMA)


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


def read_lookup_rows(folder: Path) -> pd.DataFrame:
    """Every part's lookup rows (`folder/parts/lookup`), in part-name order; DataError names a
    file that does not match LOOKUP_SCHEMA."""
    tables = []
    for path in sorted((Path(folder) / "parts" / LOOKUP).glob("*.parquet")):
        table = _decoded(path, pq.read_table)
        if table.schema.remove_metadata() != LOOKUP_SCHEMA:
            raise DataError(f"{path}: columns differ from the lookup row schema")
        tables.append(table)
    return pa.concat_tables(tables).to_pandas() if tables else \
        LOOKUP_SCHEMA.empty_table().to_pandas()


def read_parts(folder: Path) -> pa.Table:
    """Every part under `folder/parts`, validated, concatenated in part-name order."""
    parts = sorted((Path(folder) / "parts").glob("*.parquet"))
    if not parts:
        raise DataError(f"{folder}: no logged parts (run `specstop collect` first)")
    return pa.concat_tables([read_part(p) for p in parts])
