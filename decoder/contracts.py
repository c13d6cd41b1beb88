"""The three data contracts of a round (cf. vLLM spec-decode's proposals and scores).

The drafter's `Proposal` (a tree cut after the level drafted last, or the `tree` method's verify
tree) -> the target's `Scores` (its distributions over that tree) -> the verifier's `Verdict`
(the accepted path).  Shapes use n = tree.size(depth) nodes, the first `roots` of them roots, and
V the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A tree to verify: the roots and every level drafted below them, in tree (level-major)
    order."""

    tokens: torch.Tensor  # [n] long token ids
    depth: int  # levels drafted below the roots (0: the roots alone)
    root_position: int  # sequence position of the roots (the committed length)
    q: torch.Tensor  # [size(depth - 1), V] draft distribution each node's children came from
    # (a zero row for a node that was not fed)
    features: tuple[torch.Tensor, ...]  # per drafted level d: [n_d, F] float32 draft features
    # of its drafted nodes, in order (a lookup chain's nodes have none)
    fed: torch.Tensor  # [n] long, each node's index in the fed tree (the draft's cache), -1 if
    # it was not fed
    steps: int  # draft steps taken
    drafted: int  # tokens drafted (the tree's below the roots, or more when some were dropped)
    point: torch.Tensor | None = None  # [n] bool: nodes proposed by a point mass (a lookup
    # chain's, after their drafted siblings) rather than drawn from their parent's q row; None:
    # none

    @classmethod
    def root_alone(cls, roots: torch.Tensor, root_position: int, r: torch.Tensor) -> "Proposal":
        """The roots [roots] (drawn from r [V]) with nothing drafted below them (`ar`'s round,
        a round gated off)."""
        return cls(tokens=roots, depth=0, root_position=root_position,
                   q=r.new_zeros(0, r.shape[0]), features=(),
                   fed=torch.full((roots.shape[0],), -1), steps=0, drafted=0)


@dataclass(frozen=True)
class Scores:
    """The target's pass over a proposal."""

    p: torch.Tensor  # [n, V] warped target distribution after each node
    hidden: torch.Tensor | None  # [n, L * H] hidden states of the layers the drafter reads


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one tree.

    path: node indices from the root (the committed one, or lossy ti-mcsd's winner) down to the
        last accepted node.
    path_tokens: their token ids (the host's copy: what the round emits).
    path_index: [len(path)] long, `path` on the tokens' device (for gathers without a copy).
    next_dist: [V] distribution the next round's root is drawn from (the residual after a
        rejection, else the target's distribution after the last accepted node); None when an
        accepted EOS ended the sequence.
    labels: [n] int8 per node (on the tokens' device): 1 accepted, 0 rejected, -1 not reached
        (an earlier token of its branch was rejected; the roots).
    """

    path: list[int]
    path_tokens: list[int]
    path_index: torch.Tensor
    next_dist: torch.Tensor | None
    labels: torch.Tensor
