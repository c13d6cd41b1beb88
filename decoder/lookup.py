"""Prompt-lookup proposals (transformers' prompt lookup, vLLM's n-gram proposer): no draft model;
below the round's root, the tokens that followed the most recent earlier occurrence of the
text's last n tokens, as a chain.

`Lookup` keeps the committed tokens (the prompt, then every emitted token, the round's root
included before it proposes) and, for each n-gram (n in [min_ngram, max_ngram]) some token
followed, where its most recent such occurrence ends; a round looks its suffix up in
O(max_ngram), whatever the length of the text.  A proposal is a point mass, so its q rows are
one-hot and the loop's exact verification is speculative sampling with q = onehot(x)
(VERIFICATION.md §2, deterministic candidates): greedy accepts while the token is the target's
arg-max; sampling accepts x with probability p(x), else draws the correction from
res(p, onehot(x)), p with x removed.

`tree` rounds may add the chain to the draft's tree: the lookup is one more source of
candidates, with features of its own (`LOOKUP_FEATURES`: its position in the chain, the n-gram
length matched, how far back the match is, how often the lookup's next-token guess was right
over the recent text) and a learned P(accepted | parent accepted) (`LookupModel`, fitted by
stage `train` on the chains collect logs).  Where the chain's first tokens are drafted nodes it
follows them, and the rest goes below the last as a branch of its own (`dynamic.propose_tree`):
greedy, its survivals join the drafted nodes' in the tree rule's `verify_set`, which keeps the
prefix of it that pays; sampled, every drafted node is verified and the chain's prefix that pays
beside them is added.  Sampled, a chain node is a point mass beside its parent's drawn children
and is tested after them (`verify.mcss`), which stays exact whatever decided the chain: it is a
function of the text and the drafted tokens before it, none of the target's draws.  Every
feature is a function of the committed text alone, so under greedy decoding what collect logs
is what the runtime sees, whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from .contracts import Proposal
from .tree import Tree

LOOKUP_FEATURES = ("position", "ngram", "log_gap", "recent")  # `LookupMatch.features`
RECENT_WEIGHT = 0.1  # the weight of the newest token in `Lookup.recent`


class Lookup:
    """The committed tokens and the n-grams they hold, kept as tokens are committed."""

    def __init__(self, tokens: Iterable[int], max_ngram: int = 2, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its most
        # recent occurrence that a token followed
        self.recent = 0.0  # EMA over the committed tokens: 1 where the lookup's next-token
        # guess before it was that token
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Commit `tokens`, scoring the guess before each and indexing the n-grams each of them
        follows."""
        for token in tokens:
            guess = self.match(1).tokens
            self.recent += RECENT_WEIGHT * (float(guess == [token]) - self.recent)
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def match(self, k: int) -> "LookupMatch":
        """Up to k tokens that followed the most recent earlier occurrence of the text's last n
        tokens, the longest n that occurred before first (no tokens when none did)."""
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            end = self.ends.get(tuple(self.tokens[-n:]))
            if end is not None:
                return LookupMatch(self.tokens[end : end + k], n, len(self.tokens) - end,
                                   self.recent)
        return LookupMatch([], 0, 0, self.recent)

    def chain(self, k: int) -> list[int]:
        """The tokens of `match(k)`."""
        return self.match(k).tokens


@dataclass(frozen=True)
class LookupMatch:
    """A chain looked up, and what the lookup knew when it found it."""

    tokens: list[int]
    ngram: int  # the n-gram length matched (0: no match)
    gap: int  # tokens from the match's end to the text's end (>= 1)
    recent: float  # `Lookup.recent` then

    def features(self) -> np.ndarray:
        """[k, len(LOOKUP_FEATURES)] float64: each chain token's features."""
        k = len(self.tokens)
        return np.column_stack([np.arange(1, k + 1), np.full(k, self.ngram),
                                np.full(k, np.log1p(self.gap)), np.full(k, self.recent)]
                               ).astype(np.float64).reshape(k, len(LOOKUP_FEATURES))


@dataclass(frozen=True)
class LookupModel:
    """A logistic P(chain token accepted | the tokens before it were) on LOOKUP_FEATURES."""

    weights: tuple[float, ...]
    bias: float

    def __post_init__(self) -> None:
        if len(self.weights) != len(LOOKUP_FEATURES) or not np.all(np.isfinite(
                [*self.weights, self.bias])):
            raise ValueError(f"a lookup model needs {len(LOOKUP_FEATURES)} finite weights "
                             f"({', '.join(LOOKUP_FEATURES)}) and a finite bias")

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """[k] P(accepted | parent accepted) of rows [k, len(LOOKUP_FEATURES)]."""
        return 1.0 / (1.0 + np.exp(-(features @ np.asarray(self.weights) + self.bias)))

    def as_dict(self) -> dict:
        return {"features": list(LOOKUP_FEATURES), "weights": list(self.weights),
                "bias": self.bias}

    @classmethod
    def from_dict(cls, raw: dict) -> "LookupModel":
        if list(raw.get("features", [])) != list(LOOKUP_FEATURES):
            raise ValueError(f"a lookup model on features {raw.get('features')}, this "
                             f"specstop computes {list(LOOKUP_FEATURES)}")
        return cls(tuple(float(w) for w in raw["weights"]), float(raw["bias"]))


@dataclass(frozen=True)
class LookupBranch:
    """A `tree` round's lookup chain and each token's survival (the chance it and the chain's
    tokens before it are accepted)."""

    tokens: list[int]
    survival: np.ndarray  # [len(tokens)] float64, non-increasing


def lookup_branch(lookup: Lookup, levels: int, model: "LookupModel | None"
                  ) -> LookupBranch | None:
    """The chain below the round's root (committed to `lookup`), at most `levels` long, with
    its survivals from `model` (None: each token certain, the whole chain if verifying it pays);
    None when nothing is looked up."""
    match = lookup.match(levels)
    if not match.tokens:
        return None
    if model is None:
        return LookupBranch(match.tokens, np.ones(len(match.tokens)))
    return LookupBranch(match.tokens, np.cumprod(model.probabilities(match.features())))


def lookup_proposal(
    lookup: Lookup,
    roots: torch.Tensor,  # [1] long, the round's root (emitted whatever is accepted)
    r: torch.Tensor,  # [V] the distribution the root was drawn from
    root_position: int,
    levels: int,  # the longest chain to propose
) -> Proposal:
    """The chain `lookup` (the root committed) looks up below the root: q [depth, V] one-hot,
    node i's child drawn from a point mass.  One step per level proposed (a look-up, not a draft
    forward); nothing is fed to a draft."""
    chain = torch.tensor(lookup.chain(levels), dtype=torch.long, device=roots.device)
    depth = chain.shape[0]
    q = r.new_zeros(depth, r.shape[0]).scatter_(1, chain[:, None], 1.0)
    tokens = torch.cat([roots, chain])
    return Proposal(tokens=tokens, depth=depth, root_position=root_position, q=q, features=(),
                    fed=torch.full((1 + depth,), -1), steps=depth, drafted=depth)


def retrace(parent: Sequence[int], tokens: Sequence[int], chain: Sequence[int]) -> list[int]:
    """The nodes a path of `chain` tokens below node 0 follows while a tree (`parent` and
    `tokens` per node) holds them; of siblings with one token, the last."""
    child = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(parent, tokens))}
    path, node = [], 0
    for token in chain:
        node = child.get((node, token))
        if node is None:
            break
        path.append(node)
    return path


def with_chain(tree: Tree, proposal: Proposal, chain: list[int]) -> tuple[Tree, Proposal]:
    """A static tree's round with its lookup `chain` (collect's sampled rounds): the chain
    follows the drafted nodes it retraces and the rest of it goes below the last of them (or
    the root) as a branch of its own (`with_lookup_branch`), whole."""
    n = proposal.tokens.shape[0]
    path = retrace(tree.parent[:n].tolist(), proposal.tokens.tolist(), chain)
    if len(path) == len(chain):
        return tree, proposal
    return with_lookup_branch(tree, proposal, chain[len(path):], path[-1] if path else 0)


def with_lookup_branch(
    tree: Tree,
    proposal: Proposal,
    chain: list[int],  # >= 1 token
    below: int = 0,  # the node of `tree` the chain goes below
) -> tuple[Tree, Proposal]:
    """`chain` below node `below` of a round's tree as one more branch, each of its nodes after
    its drafted siblings (so the tree stays in level-major order, children after their parents'
    order, and the other nodes keep theirs).  Its nodes are not fed to the draft, carry no draft
    features (the drafted nodes keep theirs) and are marked as proposed by a point mass
    (`Proposal.point`; their own q rows are one-hot)."""
    tokens = proposal.tokens
    n, c, vocab = tokens.shape[0], len(chain), proposal.q.shape[1]
    parent = np.concatenate([tree.parent[:n].numpy(), [below], n + np.arange(c - 1)])
    depth = np.concatenate([tree.depth[:n].numpy(), int(tree.depth[below]) + 1 + np.arange(c)])
    order, new_index = [], np.empty(n + c, dtype=np.int64)
    for d in range(int(depth.max()) + 1):  # by level, by the parent's new index, chain last
        level = np.flatnonzero(depth == d)
        up = new_index[parent[level]] if d else np.zeros(len(level), dtype=np.int64)
        level = level[np.lexsort((level >= n, up))]
        new_index[level] = len(order) + np.arange(len(level))
        order.extend(level.tolist())
    order = np.array(order)
    merged = Tree.from_parents(np.where(parent[order] >= 0, new_index[parent[order]], -1))
    chain_t = torch.tensor(chain, dtype=torch.long, device=tokens.device)
    q = proposal.q.new_zeros(n + c, vocab)  # by node, the chain's nodes last
    q[: proposal.q.shape[0]] = proposal.q
    q[n : n + c - 1].scatter_(1, chain_t[1:, None], 1.0)
    order_t = torch.from_numpy(order)
    fed = torch.cat([proposal.fed, torch.full((c,), -1)])[order_t]
    order_t = order_t.to(tokens.device)
    q = q[order_t[: merged.size(merged.max_depth - 1)]]
    point = torch.zeros(n + c, dtype=torch.bool, device=tokens.device)
    point[n:] = True
    if proposal.point is not None:
        point[:n] = proposal.point
    return merged, Proposal(tokens=torch.cat([tokens, chain_t])[order_t],
                            depth=merged.max_depth, root_position=proposal.root_position, q=q,
                            features=proposal.features, fed=fed, steps=proposal.steps,
                            drafted=proposal.drafted, point=point[order_t])
