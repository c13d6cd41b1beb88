"""The tree replay against a round-by-round reference built from the runtime's own rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule, feed, verify_set
from specstop.models.tree_replay import (TreeCosts, TreeReplay, best_static, sequoia, shape_nodes,
                                         tune_dynamic)

BRANCHING = (3, 2, 2, 1)
COSTS = TreeCosts(verify=np.array([0.0, 1.0, 1.4, 1.6, 1.7]
                                  + [1.7 + 0.05 * i for i in range(1, 60)]),
                  step=np.array([0.0] + [0.05 + 0.01 * w for w in range(1, 13)]))


def superset_rows(rounds: int, seed: int, ease: float = 0.6) -> pd.DataFrame:
    """Greedy rounds on the full superset tree: at each accepted node at most one child (a
    random rank) is the target's argmax; depth capped at random in the last rounds."""
    rng = np.random.default_rng(seed)
    tree = Tree(1, BRANCHING)
    rows = []
    for r in range(rounds):
        cap = tree.max_depth if r < rounds - 3 else int(rng.integers(1, tree.max_depth + 1))
        accepted = {0}
        for i in range(1, tree.size(cap)):
            parent = int(tree.parent[i])
            if parent in accepted and not any(c in accepted for c in tree.children(parent)):
                hit = rng.uniform() < ease * 0.7 ** int(tree.rank[i])
                label = int(hit)
                if hit:
                    accepted.add(i)
            else:
                label = 0 if parent in accepted else -1
            rows.append({"prompt_id": f"p{r // 5}", "round": r % 5, "node": i, "parent": parent,
                         "depth": int(tree.depth[i]), "label": label,
                         "p": float(np.clip(rng.beta(2, 2) + 0.3 * label, 0, 1))})
    return pd.DataFrame(rows)


def reference(rows: pd.DataFrame, rule: TreeRule) -> tuple[float, float]:
    """(tokens, cost) summed over rounds, one round at a time with `feed` and `verify_set`."""
    tree = Tree(1, BRANCHING)
    tokens = cost = 0.0
    for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        by_node = {int(n): row for n, row in zip(rnd["node"], rnd.itertuples())}
        cap = int(rnd["depth"].max())
        s = {0: 1.0}
        candidates = [c for c in tree.children(0)]
        for c in candidates:
            s[c] = by_node[c].p
        fed_widths, level = [1], list(candidates)
        for d in range(1, cap):
            chosen = [c for c, f in zip(level, feed(np.array([s[c] for c in level]), rule)) if f]
            if not chosen:
                break
            fed_widths.append(len(chosen))
            level = [k for c in chosen for k in tree.children(c)]
            for k in level:
                s[k] = s[int(tree.parent[k])] * by_node[k].p
            candidates += level
        index = {c: j for j, c in enumerate(candidates)}
        parent = np.array([index.get(int(tree.parent[c]), -1) for c in candidates])
        previous = np.array([index[c - 1] if int(tree.rank[c]) > 0 else -1 for c in candidates])
        keep = verify_set(np.array([s[c] for c in candidates]), parent, previous, rule)
        kept = [c for c, k in zip(candidates, keep) if k]
        tokens += 1 + sum(by_node[c].label == 1 for c in kept)
        cost += sum(COSTS.step[w] for w in fed_widths) + COSTS.verify[1 + len(kept)]
    return tokens, cost


@pytest.mark.parametrize("expand,rho,width", [(0.0, 0.0, 8), (0.3, 1.0, 2), (0.6, 2.5, 1),
                                              (0.2, 0.7, 3), (0.99, 1.0, 4)])
def test_dynamic_replay_matches_the_runtime_rule_round_by_round(expand, rho, width):
    rows = superset_rows(40, seed=1)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    rule = COSTS.rule(BRANCHING, expand, rho, width)
    result = replay.dynamic(rows["p"].to_numpy(), rule, COSTS)
    tokens, cost = reference(rows, rule)
    assert result.speedup == pytest.approx(tokens / cost, rel=1e-12)
    assert result.tokens_per_round == pytest.approx(tokens / replay.rounds, rel=1e-12)


def test_static_chain_counts_the_accepted_rank0_prefix():
    rows = superset_rows(30, seed=2)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    chain = shape_nodes(replay.tree, (1, 1, 1), 2)
    assert chain.sum() == 3  # root, rank-0 child, rank-0 grandchild
    result = replay.static(chain, COSTS)
    tokens = cost = 0.0
    for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        on = rnd[rnd["node"].isin(np.flatnonzero(chain))]
        tokens += 1 + (on["label"] == 1).sum()
        cost += COSTS.step[1] * on["depth"].max() + COSTS.verify[1 + len(on)]
    assert result.speedup == pytest.approx(tokens / cost, rel=1e-12)


def test_oracle_bounds_every_policy_and_the_grid_contains_the_chain():
    train, val = superset_rows(60, seed=3), superset_rows(60, seed=4)
    replay = TreeReplay.from_rows(val, BRANCHING)
    oracle = replay.oracle(COSTS).speedup
    static = best_static(replay, COSTS)
    assert static["static_tree"].result.speedup >= static["static_chain"].result.speedup
    seq = sequoia(replay, TreeReplay.from_rows(train, BRANCHING), COSTS)
    tuned, rule = tune_dynamic("p", replay, val["p"].to_numpy(), COSTS, 1.0)
    for speed in (static["static_tree"].result.speedup, seq.result.speedup, tuned.result.speedup):
        assert speed <= oracle + 1e-12
    assert tuned.result.speedup == pytest.approx(replay.dynamic(val["p"].to_numpy(), rule,
                                                                COSTS).speedup)
