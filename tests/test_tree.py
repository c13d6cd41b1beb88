"""The topology-aware tree mask, its slices, parents, depths and positions."""

import itertools

import numpy as np
import pytest
import torch

from specstop.decoder.tree import Tree, chain

SHAPES = [(1, (1, 1, 1)), (1, (2, 2, 1)), (1, (3, 1, 1, 1)), (3, (1, 1, 1)), (2, (2, 3)),
          (1, (4, 2, 2, 1))]


def ancestors(tree: Tree, i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = int(tree.parent[i])
    return out


@pytest.mark.parametrize("roots,branching", SHAPES)
def test_mask_rows_are_self_plus_ancestors(roots, branching):
    tree = Tree(roots, branching)
    n = tree.size(tree.max_depth)
    for i, j in itertools.product(range(n), range(n)):
        assert bool(tree.mask[i, j]) == (j in ancestors(tree, i)), (i, j)


@pytest.mark.parametrize("roots,branching", SHAPES)
def test_sliced_mask_equals_mask_rebuilt_for_that_depth(roots, branching):
    tree = Tree(roots, branching)
    for depth in range(tree.max_depth + 1):
        rebuilt = Tree(roots, branching[:depth])
        assert torch.equal(tree.sliced_mask(depth), rebuilt.mask)
        assert torch.equal(tree.parent[: tree.size(depth)], rebuilt.parent)


@pytest.mark.parametrize("roots,branching", SHAPES)
def test_level_order_parents_depths_and_positions(roots, branching):
    tree = Tree(roots, branching)
    n = tree.size(tree.max_depth)
    assert all(int(tree.parent[i]) < i for i in range(n))  # parents come first
    for d in range(tree.max_depth + 1):
        assert (tree.depth[tree.level(d)] == d).all()
    # position = P + depth = (row sum of the full mask) - 1 + P
    assert torch.equal(tree.mask.sum(1) - 1, tree.depth)
    for d in range(1, tree.max_depth + 1):
        level = range(tree.level_start[d], tree.level_start[d + 1])
        assert [list(tree.children(int(tree.parent[i]))).index(i) for i in level] == \
            tree.rank[tree.level(d)].tolist()


def test_level_rows_are_the_draft_step_slices():
    tree = Tree(1, (2, 2, 1))
    for d in range(tree.max_depth + 1):
        rows = tree.level_rows(d)
        assert torch.equal(rows, tree.mask[tree.level(d), : tree.size(d)])
        assert rows.shape == (tree.level_start[d + 1] - tree.level_start[d], tree.size(d))


def test_children_and_paths():
    tree = Tree(1, (2, 2))
    assert list(tree.children(0)) == [1, 2]
    assert list(tree.children(2)) == [5, 6]
    assert list(tree.children(6)) == []
    assert tree.path_to(6) == [0, 2, 6]
    assert chain(3).path_to(3) == [0, 1, 2, 3]


def test_bad_widths_are_refused():
    with pytest.raises(ValueError):
        Tree(1, (2, 0))
    with pytest.raises(ValueError):
        Tree(0, (1,))


def test_parent_row_indexes_the_parent_within_its_level():
    tree = Tree(2, (3, 2, 1))
    for node in range(tree.roots, tree.size(tree.max_depth)):
        d = int(tree.depth[node])
        assert tree.level_start[d - 1] + int(tree.parent_row[node]) == int(tree.parent[node])
    assert (tree.parent_row[: tree.roots] == -1).all()


def test_padded_mask_is_the_sliced_tree_then_rows_that_see_only_themselves():
    tree = Tree(1, (3, 1, 1))
    n = tree.size(2)
    mask = tree.padded_mask(2, n + 3)
    assert torch.equal(mask[:n, :n], tree.sliced_mask(2))
    assert not mask[:n, n:].any() and not mask[n:, :n].any()  # tree and padding never mix
    assert torch.equal(mask[n:, n:], torch.eye(3, dtype=torch.bool))
    assert torch.equal(tree.padded_mask(2, n), tree.sliced_mask(2))


@pytest.mark.parametrize("roots, committed", [(1, 0), (1, 4), (3, 2)])
def test_chain_then_roots_lets_each_root_see_the_chain_and_itself(roots, committed):
    tree = Tree(roots, (2,))
    allow = tree.chain_then_roots(committed)
    m = committed
    assert torch.equal(allow[:m, :m], torch.ones(m, m, dtype=torch.bool).tril())
    assert not allow[:m, m:].any()  # the committed chain never sees the new roots
    assert allow[m:, :m].all()  # every root sees the whole chain
    assert torch.equal(allow[m:, m:], torch.eye(roots, dtype=torch.bool))  # not each other


FIELDS = ("parent", "parent_row", "depth", "rank", "root", "branch", "mask")


@pytest.mark.parametrize("roots,branching", SHAPES + [(1, ()), (2, ())])
def test_from_parents_reproduces_the_regular_tree(roots, branching):
    tree = Tree(roots, branching)
    rebuilt = Tree.from_parents(tree.parent)
    assert (rebuilt.roots, rebuilt.branching, rebuilt.level_start) == \
        (roots, branching, tree.level_start)
    for name in FIELDS:
        assert torch.equal(getattr(rebuilt, name), getattr(tree, name)), name
    n = tree.size(tree.max_depth)
    assert [list(rebuilt.children(i)) for i in range(n)] == \
        [list(tree.children(i)) for i in range(n)]


def test_from_parents_builds_an_irregular_tree():
    #        0
    #   1    2    3          level 1: 3 children of the root
    #  4 5        6          level 2: 2 under node 1, none under 2, 1 under 3
    #  7                     level 3: 1 under node 4
    tree = Tree.from_parents([-1, 0, 0, 0, 1, 1, 3, 4])
    assert tree.roots == 1 and tree.branching == (3, 2, 1) and tree.max_depth == 3
    assert tree.level_start == (0, 1, 4, 7, 8)
    assert tree.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert tree.parent_row.tolist() == [-1, 0, 0, 0, 0, 0, 2, 0]
    assert tree.branch.tolist() == [-1, 0, 1, 2, 0, 0, 2, 0]
    assert [list(tree.children(i)) for i in range(8)] == \
        [[1, 2, 3], [4, 5], [], [6], [7], [], [], []]
    for i, j in itertools.product(range(8), range(8)):
        assert bool(tree.mask[i, j]) == (j in ancestors(tree, i)), (i, j)
    assert tree.path_to(7) == [0, 1, 4, 7]
    assert torch.equal(tree.level_rows(2), tree.mask[4:7, :7])
    assert torch.equal(tree.padded_mask(1, 6)[:4, :4], tree.sliced_mask(1))


def test_from_parents_keeps_one_tree_per_shape():
    """A dynamic round builds the same few shapes again and again: each is built once, with
    its masks and device copies, whatever form its parents come in."""
    tree = Tree.from_parents([-1, 0, 0, 1, 2])
    assert Tree.from_parents(np.array([-1, 0, 0, 1, 2])) is tree
    assert Tree.from_parents(torch.tensor([-1, 0, 0, 1, 2])) is tree
    assert tree.padded_bias(2, 8, torch.float32) is \
        Tree.from_parents([-1, 0, 0, 1, 2]).padded_bias(2, 8, torch.float32)
    other = Tree.from_parents([-1, 0, 0, 1, 1])
    assert other is not tree and other.branching == (2, 2) and tree.branching == (2, 1)


@pytest.mark.parametrize("parent", [[], [0], [-1, 1], [-1, 0, 0, 1, 0], [-1, -1, 0, -1]])
def test_from_parents_refuses_what_is_not_level_major(parent):
    with pytest.raises(ValueError, match="level-major"):
        Tree.from_parents(parent)
