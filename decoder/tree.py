"""Candidate trees in level-major (BFS) order and their topology-aware causal masks.

A tree has `roots` level-0 nodes (1, or the target's top-W roots of lossy ti-mcsd) and
`branching[d-1]` children per node at level d.  One mask is built for the largest tree and
sliced to the depth actually drafted (the leading principal block), so the draft length can
change every round without rebuilding anything (VERIFICATION.md §4).  This is the one place
that builds tree masks (bool, True = may attend): the target's padded pass (`padded_mask`), a
draft step's rows (`level_rows`) and the committed chain before the roots (`chain_then_roots`);
`KVModel` turns them into the model's additive mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Tree:
    roots: int
    branching: tuple[int, ...]  # children per node at levels 1..max_depth
    parent: torch.Tensor = field(init=False, repr=False)  # [N] long, -1 for roots
    parent_row: torch.Tensor = field(init=False, repr=False)  # [N] parent's row in its level
    depth: torch.Tensor = field(init=False, repr=False)  # [N] long
    rank: torch.Tensor = field(init=False, repr=False)  # [N] long, index among siblings
    root: torch.Tensor = field(init=False, repr=False)  # [N] long, the level-0 ancestor
    branch: torch.Tensor = field(init=False, repr=False)  # [N] long, see `_branches`
    level_start: tuple[int, ...] = field(init=False)  # [max_depth + 2]
    mask: torch.Tensor = field(init=False, repr=False)  # [N, N] bool, self + ancestors

    def __post_init__(self) -> None:
        if self.roots < 1 or any(k < 1 for k in self.branching):
            raise ValueError(f"tree widths must be >= 1, got roots={self.roots} {self.branching}")
        sizes = [self.roots]
        for k in self.branching:
            sizes.append(sizes[-1] * k)
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        total = starts[-1]
        parent = torch.full((total,), -1, dtype=torch.long)
        parent_row = torch.full((total,), -1, dtype=torch.long)
        depth = torch.zeros(total, dtype=torch.long)
        rank = torch.arange(total)  # roots: their own index
        root = torch.arange(total)
        for d, k in enumerate(self.branching, start=1):
            j = torch.arange(sizes[d])
            parent_row[starts[d] : starts[d + 1]] = j // k
            parent[starts[d] : starts[d + 1]] = starts[d - 1] + j // k
            depth[starts[d] : starts[d + 1]] = d
            rank[starts[d] : starts[d + 1]] = j % k
            root[starts[d] : starts[d + 1]] = root[parent[starts[d] : starts[d + 1]]]
        mask = torch.eye(total, dtype=torch.bool)
        for i in range(starts[1], total):  # parents come first: copy the parent's row
            mask[i] |= mask[parent[i]]
        branch = _branches(self.roots, starts, parent, root)
        for name, value in [("branch", branch), ("parent", parent), ("parent_row", parent_row),
                            ("depth", depth), ("rank", rank), ("root", root),
                            ("level_start", tuple(starts)), ("mask", mask)]:
            object.__setattr__(self, name, value)

    @property
    def max_depth(self) -> int:
        return len(self.branching)

    def size(self, depth: int) -> int:
        """Number of nodes in the tree cut after level `depth` (roots are level 0)."""
        return self.level_start[depth + 1]

    def level(self, d: int) -> slice:
        return slice(self.level_start[d], self.level_start[d + 1])

    def sliced_mask(self, depth: int) -> torch.Tensor:
        """[n, n] mask of the tree cut after level `depth`: the leading principal block."""
        n = self.size(depth)
        return self.mask[:n, :n]

    def padded_mask(self, depth: int, width: int) -> torch.Tensor:
        """[width, width] `sliced_mask(depth)` followed by padding rows that see only themselves."""
        pad = width - self.size(depth)
        assert pad >= 0, (width, self.size(depth))
        return torch.block_diag(self.sliced_mask(depth), torch.eye(pad, dtype=torch.bool))

    def level_rows(self, d: int) -> torch.Tensor:
        """[n_d, size(d)] rows of level d over every node up to level d (one draft step's mask)."""
        return self.mask[self.level(d), : self.size(d)]

    def chain_then_roots(self, m: int) -> torch.Tensor:
        """[m + roots, m + roots] a causal chain of m committed tokens, then the roots, which see
        the chain and themselves (a draft's first step of a round)."""
        allow = torch.ones(m + self.roots, m + self.roots, dtype=torch.bool).tril()
        allow[m:, m:] = self.level_rows(0)
        return allow

    def children(self, node: int) -> range:
        """Indices of node's children (empty for a leaf of the largest tree)."""
        d = int(self.depth[node])
        if d >= self.max_depth:
            return range(0)
        k = self.branching[d]
        first = self.level_start[d + 1] + (node - self.level_start[d]) * k
        return range(first, first + k)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]


def chain(depth: int) -> Tree:
    """Classic speculative decoding: one root, one child per level."""
    return Tree(1, (1,) * depth)


def _branches(roots: int, starts: list[int], parent: torch.Tensor, root: torch.Tensor
              ) -> torch.Tensor:
    """Which branch each node belongs to: its root when there are several roots (lossy
    ti-mcsd), else the index of its level-1 ancestor within level 1 (-1 for the root)."""
    if roots > 1:
        return root.clone()
    branch = torch.full_like(parent, -1)
    if len(starts) > 2:
        branch[starts[1] : starts[2]] = torch.arange(starts[2] - starts[1])
        for i in range(starts[2], starts[-1]):
            branch[i] = branch[parent[i]]
    return branch
