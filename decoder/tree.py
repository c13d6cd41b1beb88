"""Candidate trees in level-major (BFS) order and their topology-aware causal masks.

A static tree has `roots` level-0 nodes (1, or the target's top-W roots of lossy ti-mcsd) and
`branching[d-1]` children per node at level d; `Tree.from_parents` builds a tree of any shape
(the `tree` method's fed and verified trees, `dynamic.py`).  One mask is built for the largest
tree and sliced to the depth actually drafted (the leading principal block), so the draft length
can change every round without rebuilding anything (VERIFICATION.md §4).  This is the one place
that builds tree masks (bool, True = may attend): the target's padded pass (`padded_mask`), a
draft step's rows (`level_rows`) and the committed chain before the roots (`chain_then_roots`);
`additive` turns them into the model's additive mask.  A tree is built on the host; `Tree.on`
gives its copy on the decoding device (one transfer, once per device), which keeps the additive
masks of the target's pass and of the draft steps once built (`padded_bias`, `level_bias`), so a
round sends nothing to the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch

TREES_KEPT = 1024  # trees `from_parents` keeps by shape (a decode builds a few dozen)


@dataclass(frozen=True)
class Tree:
    roots: int
    branching: tuple[int, ...]  # children per node at levels 1..max_depth (most children of a
    # node at each level for a tree `from_parents`)
    parent: torch.Tensor = field(init=False, repr=False)  # [N] long, -1 for roots
    parent_row: torch.Tensor = field(init=False, repr=False)  # [N] parent's row in its level
    depth: torch.Tensor = field(init=False, repr=False)  # [N] long
    rank: torch.Tensor = field(init=False, repr=False)  # [N] long, index among siblings
    root: torch.Tensor = field(init=False, repr=False)  # [N] long, the level-0 ancestor
    branch: torch.Tensor = field(init=False, repr=False)  # [N] long, see `_build`
    level_start: tuple[int, ...] = field(init=False)  # [max_depth + 2]
    child_start: tuple[int, ...] = field(init=False, repr=False)  # [N + 1] node i's children
    # are child_start[i]:child_start[i + 1]
    mask: torch.Tensor = field(init=False, repr=False)  # [N, N] bool, self + ancestors
    # not fields: `_copies` (by device, on the host tree), `_biases` (additive masks by key)

    def __post_init__(self) -> None:
        if self.roots < 1 or any(k < 1 for k in self.branching):
            raise ValueError(f"tree widths must be >= 1, got roots={self.roots} {self.branching}")
        self._build(_regular_parents(self.roots, self.branching))

    @classmethod
    def from_parents(cls, parent: torch.Tensor | np.ndarray | Sequence[int]) -> Tree:
        """The tree whose node i has parent `parent[i]` ([N] long, -1 for a root): parents come
        before children, levels are contiguous, a node's children are contiguous and in rank
        order and children follow their parents' order (so `parent` is non-decreasing).  One
        tree per shape is built and kept (`_tree_of_parents`): callers must not change it."""
        parent = np.array(parent.numpy() if isinstance(parent, torch.Tensor) else parent,
                          dtype=np.int64).ravel()
        return _tree_of_parents(parent.tobytes())

    @classmethod
    def _built_from(cls, parent: np.ndarray) -> Tree:
        """`from_parents` without the keeping."""
        n = parent.shape[0]
        if n == 0 or parent[0] != -1 or (parent >= np.arange(n)).any() \
                or (np.diff(parent) < 0).any():
            raise ValueError(f"not a tree in level-major order: parents {parent.tolist()}")
        tree = object.__new__(cls)  # `roots` and `branching` follow from the parents
        tree._build(parent)
        return tree

    def _build(self, parent: np.ndarray) -> None:
        """Every field from a valid parent array [N] (level-major, children contiguous); NumPy
        (a round builds small trees: torch's per-op overhead would dominate)."""
        n = parent.shape[0]
        index = np.arange(n)
        child_start = np.searchsorted(parent, np.arange(n + 1))  # first with parent >= i
        starts = [0, int((parent < 0).sum())]
        while starts[-1] < n:  # level d + 1: the children of level d
            starts.append(int(child_start[starts[-1]]))
        sizes = np.diff(starts)
        depth = np.repeat(np.arange(len(sizes)), sizes)
        has_parent, up = parent >= 0, parent.clip(min=0)
        parent_row = np.where(has_parent, parent - np.array(starts)[(depth - 1).clip(min=0)], -1)
        rank = np.where(has_parent, index - child_start[up], index)  # roots: their own index
        level_1_ancestor = index.copy()  # roots and level 1: themselves
        mask = np.eye(n, dtype=bool)
        for d in range(1, len(sizes)):  # parents come first: copy the parent's row
            level = slice(starts[d], starts[d + 1])
            mask[level] |= mask[parent[level]]
            if d > 1:
                level_1_ancestor[level] = level_1_ancestor[parent[level]]
        root = np.where(has_parent, up[level_1_ancestor], index)
        roots = starts[1]
        # which branch a node belongs to: its root when there are several roots (lossy ti-mcsd),
        # else the index of its level-1 ancestor within level 1 (-1 for the root)
        branch = root.copy() if roots > 1 else np.where(has_parent, level_1_ancestor - roots, -1)
        children = np.diff(child_start)
        branching = tuple(int(children[starts[d] : starts[d + 1]].max())
                          for d in range(len(sizes) - 1))
        for name, value in [("branch", branch), ("parent", parent), ("parent_row", parent_row),
                            ("depth", depth), ("rank", rank), ("root", root), ("mask", mask)]:
            object.__setattr__(self, name, torch.from_numpy(value))
        for name, value in [("roots", roots), ("branching", branching),
                            ("level_start", tuple(starts)),
                            ("child_start", tuple(child_start.tolist()))]:
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
        return torch.block_diag(self.sliced_mask(depth),
                                torch.eye(pad, dtype=torch.bool, device=self.mask.device))

    def level_rows(self, d: int) -> torch.Tensor:
        """[n_d, size(d)] rows of level d over every node up to level d (one draft step's mask)."""
        return self.mask[self.level(d), : self.size(d)]

    def chain_then_roots(self, m: int) -> torch.Tensor:
        """[m + roots, m + roots] a causal chain of m committed tokens, then the roots, which see
        the chain and themselves (a draft's first step of a round)."""
        allow = torch.ones(m + self.roots, m + self.roots, dtype=torch.bool,
                           device=self.mask.device).tril()
        allow[m:, m:] = self.level_rows(0)
        return allow

    def padded_bias(self, depth: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """`padded_mask(depth, width)` as an additive mask of `dtype`, built once."""
        return self._bias(("padded", depth, width, dtype),
                          lambda: additive(self.padded_mask(depth, width), dtype))

    def level_bias(self, d: int, dtype: torch.dtype) -> torch.Tensor:
        """`level_rows(d)` as an additive mask of `dtype`, built once."""
        return self._bias(("level", d, dtype), lambda: additive(self.level_rows(d), dtype))

    def _bias(self, key: tuple, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        biases = self.__dict__.setdefault("_biases", {})
        if key not in biases:
            biases[key] = build()
        return biases[key]

    def on(self, device: torch.device) -> Tree:
        """This tree with its tensors on `device` (itself when they are there): copied in one
        host->device transfer the first time, then kept."""
        if self.mask.device == device:
            return self
        copies = self.__dict__.setdefault("_copies", {})
        if device not in copies:
            copies[device] = self._copied_to(device)
        return copies[device]

    def _copied_to(self, device: torch.device) -> Tree:
        """The copy `on` keeps: every tensor packed into one transfer."""
        n = self.mask.shape[0]
        packed = torch.cat([*(getattr(self, name) for name in INDEX_FIELDS),
                            self.mask.flatten().long()]).to(device)
        *indices, mask = packed.split([n] * len(INDEX_FIELDS) + [n * n])
        tree = object.__new__(Tree)
        for name in ("roots", "branching", "level_start", "child_start"):
            object.__setattr__(tree, name, getattr(self, name))
        for name, value in zip(INDEX_FIELDS, indices):
            object.__setattr__(tree, name, value)
        object.__setattr__(tree, "mask", mask.view(n, n).bool())
        return tree

    def children(self, node: int) -> range:
        """Indices of node's children (empty for a leaf)."""
        return range(self.child_start[node], self.child_start[node + 1])

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]


@lru_cache(maxsize=TREES_KEPT)
def _tree_of_parents(parent: bytes) -> Tree:
    """`Tree.from_parents` of an int64 parent array's bytes, kept: a dynamic tree's rounds
    build a few dozen shapes again and again (95% of the calls in a decode), and a kept tree
    keeps its device copy and additive masks too."""
    return Tree._built_from(np.frombuffer(parent, dtype=np.int64).copy())


INDEX_FIELDS = ("parent", "parent_row", "depth", "rank", "root", "branch")  # [N] long each


def additive(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's additive mask of a bool mask: 0 where it may attend, `dtype`'s minimum
    elsewhere (a bool mask is silently wrong under eager attention)."""
    bias = torch.zeros(allow.shape, dtype=dtype, device=allow.device)
    return bias.masked_fill_(~allow, torch.finfo(dtype).min)


def chain(depth: int) -> Tree:
    """Classic speculative decoding: one root, one child per level."""
    return Tree(1, (1,) * depth)


def _regular_parents(roots: int, branching: tuple[int, ...]) -> np.ndarray:
    """[N] parents of the tree with `roots` roots and `branching[d-1]` children per node at
    level d, in level-major order."""
    parts, start, size = [np.full(roots, -1)], 0, roots
    for k in branching:
        parts.append(start + np.arange(size).repeat(k))
        start, size = start + size, size * k
    return np.concatenate(parts).astype(np.int64)
