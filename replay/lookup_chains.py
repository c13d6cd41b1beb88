"""The logged lookup chains (`collection.rows.LOOKUP_SCHEMA`) of the replayed rounds.

Greedy `tree` rounds with a lookup branch add the chain to the drafted tree: where its first
tokens retrace drafted nodes it follows them (`match`: the replayed row each chain row is, while
the chain retraces the logged superset tree), the rest goes below the last as a branch of its
own, and a round gated off proposes the chain alone; `verify_set` keeps what pays
(`dynamic.propose_tree`).  `lookup` alone verifies every chain whole, and since collect logs the
chain below every token of the text, it is walked along each text exactly (`lookup_alone`):
its rounds start where its own accepted chains end, not where the logged rounds did (a round
that copies ten tokens is one round, not one per logged round inside them).  A chain
row is accepted iff it and the rows before it are the text's (label 1): whatever else the round
verifies, so the replay scores any prefix exactly, as it does the drafted rows.  A sampled
round's chain was verified beside its drafted tree and each row carries its exact acceptances
(`accept_after`), with which `replay.tree_replay` scores it beside any sub-tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from specstop.collection.data import ROUND_KEYS
from specstop.decoder.lookup import LOOKUP_FEATURES, LookupModel

from .simulate import parent_rows


@dataclass(frozen=True)
class LookupChains:
    """Chain rows [m], each chain's rows in order, of the rounds of a replay."""

    round_index: np.ndarray  # [m] the replay's round (`TreeReplay.round_index` numbering)
    position: np.ndarray  # [m] 1 = below the root
    features: np.ndarray  # [m, len(LOOKUP_FEATURES)] float64
    accepted: np.ndarray  # [m] bool, label 1
    match: np.ndarray  # [m] the replay's row with this row's token and parent (the row
    # matched before it, the root for the first), while the chain retraces the superset; -1 after
    accept_after: np.ndarray  # [m, K + 1] sampled rows: P(accepted at the parent | it was and
    # its first k drafted children were rejected), nan past the parent's children; [m, 0] greedy

    @classmethod
    def from_rows(cls, chains: pd.DataFrame, rows: pd.DataFrame) -> "LookupChains":
        """The `chains` of the replayed `rows` (ROUND_KEYS, node, parent, depth and token of
        every row, in the replay's order; its temperature where it has one), rows of every other
        round or temperature dropped."""
        if "temperature" in rows and len(rows):
            chains = chains[chains["temperature"] == rows["temperature"].iloc[0]]
        round_index = rows.groupby(ROUND_KEYS, sort=False, observed=True).ngroup().to_numpy()
        keys = rows[ROUND_KEYS].astype({"prompt_id": str}).assign(replay_round=round_index)
        joined = chains.astype({"prompt_id": str}).merge(keys.drop_duplicates(), on=ROUND_KEYS,
                                                         how="inner", sort=False)
        joined = joined.sort_values(["replay_round", "position"], kind="stable")
        position = joined["position"].to_numpy(np.int64)
        drafted = pd.DataFrame({  # (round, parent row, token) -> row: greedy siblings differ
            "replay_round": round_index, "token": rows["token"].to_numpy(np.int64),
            "up": parent_rows(round_index, rows["node"].to_numpy(np.int64),
                              rows["parent"].to_numpy(np.int64)),
            "row": np.arange(len(rows))})
        match = np.full(len(joined), -1, dtype=np.int64)
        for j in range(1, int(position.max(initial=0)) + 1):
            at = np.flatnonzero(position == j)
            up = np.full(len(at), -1) if j == 1 else match[at - 1]
            wanted = pd.DataFrame({"replay_round": joined["replay_round"].to_numpy()[at],
                                   "token": joined["token"].to_numpy(np.int64)[at], "up": up,
                                   "at": at})
            found = wanted[up >= 0 if j > 1 else np.ones(len(at), bool)].merge(
                drafted, on=["replay_round", "up", "token"], how="inner")
            match[found["at"].to_numpy()] = found["row"].to_numpy()
        after = joined["accept_after"].tolist() if "accept_after" in joined else []
        width = max((len(a) for a in after), default=0)
        accept_after = np.full((len(joined), width), np.nan)
        for i, values in enumerate(after):
            accept_after[i, : len(values)] = values
        return cls(joined["replay_round"].to_numpy(np.int64), position,
                   joined[list(LOOKUP_FEATURES)].to_numpy(np.float64),
                   joined["label"].to_numpy() == 1, match, accept_after)

    def __len__(self) -> int:
        return len(self.round_index)

    def survival(self, model: LookupModel | None) -> np.ndarray:
        """[m] each row's survival: the product of the model's p along its chain (None: 1)."""
        if model is None:
            return np.ones(len(self))
        p = pd.Series(model.probabilities(self.features))
        return p.groupby(self.round_index, sort=False).cumprod().to_numpy()


def lookup_alone(chains: pd.DataFrame, verify: np.ndarray) -> dict:
    """`lookup` alone walked along each prompt's text (`chains`: every logged chain row of the
    prompts, greedy): a round whose root is the text's token e - 1 verifies its whole chain
    (`verify` [n]: a pass over n tokens, in `ar` steps), emits the root and the accepted
    prefix, and the next round's root is the text's next token; speed vs `ar` (speedup 1)."""
    tokens = cost = rounds = verified = 0.0
    for _, prompt in chains.groupby("prompt_id", sort=False, observed=True):
        starts = prompt.groupby("emitted", sort=False)
        length = starts.size().to_dict()
        accepted = starts["label"].agg(lambda labels: int((labels == 1).sum())).to_dict()
        emitted, end = 1, int(prompt["text_tokens"].iloc[0])
        while emitted <= end:
            a, n = accepted.get(emitted, 0), length.get(emitted, 0)
            tokens, cost = tokens + 1 + a, cost + verify[1 + n]
            rounds, verified = rounds + 1, verified + n
            emitted += 1 + a
    return {"simulated_speedup": tokens / cost if cost else None,
            "tokens_per_call": tokens / rounds if rounds else None,
            "verified_nodes": verified / rounds if rounds else None}
