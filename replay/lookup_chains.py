"""The logged lookup chains (`collection.rows.LOOKUP_SCHEMA`) of the replayed greedy rounds.

Greedy `tree` rounds with a lookup branch add the chain below the root unless the draft proposed
its first token there (`beside_draft`), and a round gated off proposes its chain alone;
`verify_set` keeps the prefix of it that pays.  `lookup` alone verifies every chain whole, and since collect logs the
chain below every token of the text, it is walked along each text exactly (`lookup_alone`):
its rounds start where its own accepted chains end, not where the logged rounds did (a round
that copies ten tokens is one round, not one per logged round inside them).  A chain
row is accepted iff it and the rows before it are the text's (label 1): whatever else the round
verifies, so the replay scores any prefix exactly, as it does the drafted rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from specstop.collection.data import ROUND_KEYS
from specstop.decoder.lookup import LOOKUP_FEATURES, LookupModel


@dataclass(frozen=True)
class LookupChains:
    """Chain rows [m], each chain's rows in order, of the rounds of a replay."""

    round_index: np.ndarray  # [m] the replay's round (`TreeReplay.round_index` numbering)
    position: np.ndarray  # [m] 1 = below the root
    features: np.ndarray  # [m, len(LOOKUP_FEATURES)] float64
    accepted: np.ndarray  # [m] bool, label 1
    beside_draft: np.ndarray  # [m] bool, the draft proposed the chain's first token at the root

    @classmethod
    def from_rows(cls, chains: pd.DataFrame, rounds: pd.DataFrame) -> "LookupChains":
        """The `chains` of `rounds` (the replay's rows: ROUND_KEYS in the order its rounds are
        numbered), rows of every other round dropped."""
        keys = rounds[ROUND_KEYS].astype({"prompt_id": str}).drop_duplicates()
        keys = keys.assign(replay_round=np.arange(len(keys)))
        joined = chains.astype({"prompt_id": str}).merge(keys, on=ROUND_KEYS, how="inner",
                                                         sort=False)
        joined = joined.sort_values(["replay_round", "position"], kind="stable")
        return cls(joined["replay_round"].to_numpy(np.int64),
                   joined["position"].to_numpy(np.int64),
                   joined[list(LOOKUP_FEATURES)].to_numpy(np.float64),
                   joined["label"].to_numpy() == 1, joined["beside_draft"].to_numpy(bool))

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
