"""Names, dtypes and version of the per-drafted-token feature vector.

Bump SCHEMA_VERSION whenever a feature is added, removed, reordered or redefined: stop models
record the version they were trained on and the runtime refuses a mismatch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEMA_VERSION = 3
TOP_K = 10


@dataclass(frozen=True)
class Feature:
    name: str
    dtype: str
    description: str


FEATURES: tuple[Feature, ...] = (
    Feature("q_token", "float32", "draft probability of the proposed token"),
    Feature("q_top1", "float32", "draft top-1 probability"),
    Feature("q_top2", "float32", "draft top-2 probability"),
    Feature("q_margin", "float32", "top-1 minus top-2 probability"),
    Feature("q_entropy", "float32", "entropy of the draft distribution (nats)"),
    *(Feature(f"q_top{i}_sorted", "float32", f"draft probability of rank {i}")
      for i in range(1, TOP_K + 1)),
    Feature("depth", "float32", "level of the token within the round (1 = first drafted)"),
    Feature("sibling_rank", "float32", "rank among the candidates drafted at the same node"),
    Feature("root_rank", "float32", "rank of the branch's root (target-initialized roots)"),
    Feature("root_target_prob", "float32", "target probability of the branch's root token"),
    Feature("path_confidence", "float32", "product of draft probabilities along the branch"),
    Feature("tokens_generated", "float32", "tokens generated so far in this sequence"),
    Feature("prev_accepted", "float32", "drafted tokens accepted in the previous round"),
    Feature("running_acceptance", "float32", "acceptance rate of drafted tokens so far"),
    Feature("accepted_ema", "float32", "exponential moving average of the tokens accepted per "
            "round (recent rounds weigh most)"),
    Feature("root_entropy", "float32", "entropy of the target's distribution the round's root "
            "was drawn from (nats; known before drafting)"),
    Feature("root_margin", "float32", "top-1 minus top-2 probability of that target "
            "distribution"),
    Feature("lookup_agrees", "float32", "1 where the branch below the root, this token "
            "included, is the prefix of the round's prompt-lookup chain (the tokens that followed "
            "the text's last n-gram where it occurred before)"),
    Feature("lookup_disagrees", "float32", "1 where the branch above this token is the chain's "
            "prefix and the chain goes on with another token"),
    Feature("lookup_ngram", "float32", "n-gram length the round's chain was matched on (0: no "
            "chain)"),
    Feature("lookup_recent", "float32", "how often the lookup's next-token guess was right over "
            "the recent text (EMA)"),
)


FEATURE_GROUPS: dict[str, tuple[str, ...]] = {  # what each kind of signal is (ablations)
    "draft": ("q_token", "q_top1", "q_top2", "q_margin", "q_entropy",
              *(f"q_top{i}_sorted" for i in range(1, TOP_K + 1))),
    "tree_position": ("depth", "sibling_rank", "root_rank", "path_confidence"),
    "history": ("tokens_generated", "prev_accepted", "running_acceptance", "accepted_ema"),
    "target_root": ("root_target_prob", "root_entropy", "root_margin"),
    "lookup": ("lookup_agrees", "lookup_disagrees", "lookup_ngram", "lookup_recent"),
}


def feature_index(name: str) -> int:
    """Column of a feature in the feature vector."""
    for i, f in enumerate(FEATURES):
        if f.name == name:
            return i
    raise KeyError(f"unknown feature '{name}'")


def schema_dict() -> dict:
    """The schema as saved beside data and inside exported stop models."""
    return {"version": SCHEMA_VERSION, "features": [asdict(f) for f in FEATURES]}
