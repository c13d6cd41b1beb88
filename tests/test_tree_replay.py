"""The tree replay against a round-by-round reference built from the runtime's own rule."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import pytest

import torch

from specstop.decoder.contracts import Proposal
from specstop.decoder.costs import RoundWork
from specstop.decoder.dynamic import verify_with_chain
from specstop.decoder.lookup import LOOKUP_FEATURES, LookupBranch, LookupModel, with_chain
from specstop.decoder.sampling import Sampling
from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule, children, feed, verify_set
from specstop.decoder.verify import acceptance, chain_acceptance, sampled_walk
from specstop.replay.lookup_chains import LookupChains
from specstop.replay.tree_replay import (TreeCosts, TreeReplay, best_static, sequoia, shape_nodes,
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
                         "depth": int(tree.depth[i]), "label": label, "token": 1000 + i,
                         "p": float(np.clip(rng.beta(2, 2) + 0.3 * label, 0, 1))})
    return pd.DataFrame(rows)


@dataclass
class Rounds:
    """Each round's tokens and cost under a policy, and the tokens the logged superset round
    yielded (the logging run's step there)."""

    tokens: list[float] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    logged: list[float] = field(default_factory=list)

    def add(self, tokens: float, cost: float, logged: float) -> None:
        self.tokens.append(tokens), self.cost.append(cost), self.logged.append(logged)

    def speed(self) -> float:
        """A run of the policy along the logged text: each logged round stands for the `logged`
        tokens from its start, which the policy passes at cost / tokens each."""
        t, c, n = (np.array(x) for x in (self.tokens, self.cost, self.logged))
        return n.sum() / (n * c / t).sum()

    def tokens_per_round(self) -> float:
        """The same run's tokens per round: the tokens passed over the rounds started."""
        t, n = np.array(self.tokens), np.array(self.logged)
        return n.sum() / (n / t).sum()


def reference(rows: pd.DataFrame, rule: TreeRule, chains: pd.DataFrame | None = None,
              model: LookupModel | None = None, gated: frozenset = frozenset()) -> Rounds:
    """Each round's tokens and cost, one round at a time with `feed` and `verify_set`; with
    `chains`, each round's chain ranked with the drafted candidates by its survival under
    `model` (None: certain), as `dynamic.propose_tree` does: its first tokens that retrace
    drafted candidates are those candidates, with the larger survival, the rest goes below the
    last of them (after the drafted ones); the rounds `gated` ((prompt_id, round) keys) draft
    nothing and rank their chain alone, as `dynamic.propose_chain` does."""
    tree = Tree(1, BRANCHING)
    out = Rounds()
    for key, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        by_node = {int(n): row for n, row in zip(rnd["node"], rnd.itertuples())}
        cap = 1 if key in gated else int(rnd["depth"].max())
        s = {0: 1.0}
        candidates = [] if key in gated else [c for c in tree.children(0)]
        for c in candidates:
            s[c] = by_node[c].p
        fed_widths, level = [1] if candidates else [], list(candidates)
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
        n = len(candidates)
        survival = [s[c] for c in candidates]
        parent = [index.get(int(tree.parent[c]), -1) for c in candidates]
        previous = [index[c - 1] if int(tree.rank[c]) > 0 else -1 for c in candidates]
        accepted = [by_node[c].label == 1 for c in candidates]
        chain = chains[(chains["prompt_id"] == key[0]) & (chains["round"] == key[1])] \
            if chains is not None else chains
        if chain is not None and len(chain):
            chain_s = np.ones(len(chain)) if model is None else np.cumprod(
                model.probabilities(chain[list(LOOKUP_FEATURES)].to_numpy(np.float64)))
            at, m = 0, 0  # the chain's node in the drafted tree, the tokens it retraced
            for token in chain["token"]:
                same = [c for c in candidates if int(tree.parent[c]) == at and by_node[c].token
                        == token]
                if not same:
                    break
                at = same[0]
                survival[index[at]] = max(survival[index[at]], chain_s[m])
                m += 1
            rest = len(chain) - m
            parent += [index.get(at, -1)] + [n + j for j in range(rest - 1)] if rest else []
            previous += [-1] * rest
            survival += chain_s[m:].tolist()
            accepted += (chain["label"].iloc[m:] == 1).tolist()
        keep = verify_set(np.array(survival), np.array(parent, dtype=np.int64),
                          np.array(previous, dtype=np.int64), rule)
        out.add(1 + sum(a for a, k in zip(accepted, keep) if k),
                sum(COSTS.step[w] for w in fed_widths) + COSTS.verify[1 + int(keep.sum())],
                1 + (rnd["label"] == 1).sum())
    return out


@pytest.mark.parametrize("expand,rho,width", [(0.0, 0.0, 8), (0.3, 1.0, 2), (0.6, 2.5, 1),
                                              (0.2, 0.7, 3), (0.99, 1.0, 4)])
def test_dynamic_replay_matches_the_runtime_rule_round_by_round(expand, rho, width):
    rows = superset_rows(40, seed=1)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    rule = COSTS.rule(BRANCHING, expand, rho, width)
    result = replay.dynamic(rows["p"].to_numpy(), rule, COSTS)
    rounds = reference(rows, rule)
    assert result.speedup == pytest.approx(rounds.speed(), rel=1e-12)
    assert result.tokens_per_round == pytest.approx(rounds.tokens_per_round(), rel=1e-12)


def test_static_chain_counts_the_accepted_rank0_prefix():
    rows = superset_rows(30, seed=2)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    chain = shape_nodes(replay.tree, (1, 1, 1), 2)
    assert chain.sum() == 3  # root, rank-0 child, rank-0 grandchild
    result = replay.static(chain, COSTS)
    rounds = Rounds()
    for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        on = rnd[rnd["node"].isin(np.flatnonzero(chain))]
        rounds.add(1 + (on["label"] == 1).sum(),
                   COSTS.step[1] * on["depth"].max() + COSTS.verify[1 + len(on)],
                   1 + (rnd["label"] == 1).sum())
    assert result.speedup == pytest.approx(rounds.speed(), rel=1e-12)


def test_a_drafted_round_pays_its_kinds_host_overhead_and_a_gated_one_does_not():
    """A static shape's round pays `static_round`, a dynamic tree's `round`."""
    rows = superset_rows(30, seed=2)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    costs = replace(COSTS, round=RoundWork(0.5), static_round=RoundWork(0.3))
    chain = shape_nodes(replay.tree, (1, 1, 1), 2)
    rounds = Rounds()
    for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        on = rnd[rnd["node"].isin(np.flatnonzero(chain))]
        rounds.add(1 + (on["label"] == 1).sum(),
                   COSTS.step[1] * on["depth"].max() + COSTS.verify[1 + len(on)] + 0.3,
                   1 + (rnd["label"] == 1).sum())
    assert replay.static(chain, costs).speedup == pytest.approx(rounds.speed(), rel=1e-12)
    rule = costs.rule(BRANCHING, 0.1, 1.0, 2)
    p = rows["p"].to_numpy()
    gated = replay.dynamic(p, rule, costs, gated=np.ones(replay.rounds, dtype=bool))
    assert gated.speedup == pytest.approx(1.0)  # `ar`: the root alone, no draft, no overhead
    assert replay.dynamic(p, rule, costs).speedup < replay.dynamic(p, rule, COSTS).speedup
    assert replay.dynamic(p, rule, costs) == replay.dynamic(p, rule, replace(
        costs, static_round=RoundWork()))
    assert replay.oracle(costs).speedup < replay.oracle(COSTS).speedup


def test_a_drafted_round_pays_a_base_and_a_term_per_level_it_drafts():
    rows = superset_rows(30, seed=3)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    costs = replace(COSTS, static_round=RoundWork(0.1, 0.2))
    for depth in (1, 2, 3):
        chain = shape_nodes(replay.tree, (1, 1, 1), depth)
        rounds = Rounds()
        for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
            on = rnd[rnd["node"].isin(np.flatnonzero(chain))]
            levels = on["depth"].max()
            rounds.add(1 + (on["label"] == 1).sum(),
                       COSTS.step[1] * levels + COSTS.verify[1 + len(on)] + 0.1 + 0.2 * levels,
                       1 + (rnd["label"] == 1).sum())
        assert replay.static(chain, costs).speedup == pytest.approx(rounds.speed(), rel=1e-12)
    per_level = replace(COSTS, round=RoundWork(0.0, 0.2))
    assert replay.oracle(per_level).speedup < replay.oracle(COSTS).speedup


def logged_walk(easy: np.ndarray, tree: Tree) -> tuple[pd.DataFrame, int]:
    """The logging run along a greedy text: `easy[y]` says the draft's rank-0 token at text
    position y is the target's.  Each round drafts the superset tree at its start x (only the
    rank-0 chain can be accepted) and the run moves on by the tokens it yields.  Returns the
    rows and the position where the walk stopped."""
    rows, x, r = [], 0, 0
    end = len(easy) - tree.max_depth
    while x < end:
        accepted = {0}
        for i in range(1, len(tree.parent)):
            parent = int(tree.parent[i])
            hit = parent in accepted and int(tree.rank[i]) == 0 and easy[x + tree.depth[i] - 1]
            if hit:
                accepted.add(i)
            rows.append({"prompt_id": f"p{r // 1000}", "round": r % 1000, "node": i,
                         "parent": parent, "depth": int(tree.depth[i]), "token": 1000 + i,
                         "label": 1 if hit else 0 if parent in accepted else -1})
        x, r = x + len(accepted), r + 1
    return pd.DataFrame(rows), end


def test_the_replay_is_a_run_of_the_policy_along_the_logged_text():
    """A policy that yields more tokens per round than the logging run starts fewer rounds:
    the replay weights each logged round for where the policy's own run starts them, and comes
    within 3% of walking the text with each static chain (the logging policy itself exactly);
    the plain mean over logged rounds (the negative control) misses by more."""
    rng = np.random.default_rng(0)
    ease = np.where((np.arange(6000) // 40) % 2 == 0, 0.95, 0.3)  # easy and hard stretches
    easy = rng.uniform(size=len(ease)) < ease
    tree = Tree(1, BRANCHING)
    rows, end = logged_walk(easy, tree)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    for depth in range(1, tree.max_depth + 1):
        chain = shape_nodes(tree, (1, 1, 1), depth)
        cost = depth * COSTS.step[1] + COSTS.verify[1 + depth]
        x = tokens = rounds = 0
        while x < end:
            accepted = 0
            while accepted < depth and easy[x + accepted]:
                accepted += 1
            x, tokens, rounds = x + 1 + accepted, tokens + 1 + accepted, rounds + 1
        walked = tokens / (rounds * cost)
        replayed = replay.static(chain, COSTS).speedup
        plain = (1 + (replay.accepted & chain[replay.node]).sum() / replay.rounds) / cost
        if depth == tree.max_depth:  # the logging policy
            assert replayed == pytest.approx(walked, rel=1e-9)
        else:
            assert replayed == pytest.approx(walked, rel=0.03)
            assert abs(replayed - walked) < abs(plain - walked)


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


# ---- sampled rounds: exact expected tokens -------------------------------------------------


def sampled_rows(rounds: int, seed: int) -> pd.DataFrame:
    """Sampled rounds on the superset tree: every node's exact acceptance at its parent (given
    the parent accepted and the earlier siblings rejected), lower for later ranks."""
    rng = np.random.default_rng(seed)
    tree = Tree(1, BRANCHING)
    rows = []
    for r in range(rounds):
        cap = tree.max_depth if r < rounds - 3 else int(rng.integers(1, tree.max_depth + 1))
        for i in range(1, tree.size(cap)):
            a = float(rng.uniform(0, 1) * 0.6 ** int(tree.rank[i]))
            rows.append({"prompt_id": f"p{r // 5}", "temperature": 0.7, "round": r % 5,
                         "node": i, "parent": int(tree.parent[i]), "depth": int(tree.depth[i]),
                         "token": 1000 + i,
                         "label": -1, "accept_prob": a, "p": float(rng.beta(2, 2))})
    return pd.DataFrame(rows)


def walks(accept: dict[int, float], kept: set[int], tree: Tree, n: int,
          rng: np.random.Generator) -> float:
    """Mean accepted drafted tokens of n draws of the multi-candidate walk over `kept`: at each
    node its kept children are tested in rank order, each accepted with its probability."""
    total = 0
    for _ in range(n):
        node = 0
        while True:
            for child in (c for c in tree.children(node) if c in kept):
                if rng.uniform() < accept[child]:
                    node, total = child, total + 1
                    break
            else:
                break
    return total / n


def test_sampled_expected_tokens_by_hand():
    """Root children a = .5, .4; below the first, a = .3, .6: 1 + .5 + .5 * .4 + .5 * .3
    + .5 * .7 * .6 tokens per round."""
    rows = pd.DataFrame({"prompt_id": "p", "temperature": 0.7, "round": 0, "node": [1, 2, 3, 4],
                         "parent": [0, 0, 1, 1], "depth": [1, 1, 2, 2], "label": [1, -1, 0, 1],
                         "accept_prob": [0.5, 0.4, 0.3, 0.6]})
    replay = TreeReplay.from_rows(rows, (2, 2))
    result = replay.static(np.ones(len(replay.tree.parent), dtype=bool), COSTS)
    assert result.tokens_per_round == pytest.approx(1 + 0.5 + 0.2 + 0.15 + 0.21, abs=1e-12)


def sampling_rule_round(rnd: pd.DataFrame, rule: TreeRule, tree: Tree) -> tuple[set[int], list[int]]:
    """The sampling rule's tree of one logged round, built level by level by `children` (the
    runtime's rule): (the nodes drafted and verified, the width fed at each level)."""
    p = {int(n): x for n, x in zip(rnd["node"], rnd["p"])}
    s, level, kept, widths = {0: 1.0}, [0], set(), []
    for d in range(int(rnd["depth"].max())):
        counts = children(np.array([s[c] for c in level]), d, rule, nodes=1 + len(kept))
        if not any(k > 0 for k in counts):
            break
        widths.append(sum(k > 0 for k in counts))
        level = [k for c, n in zip(level, counts) for k in tree.children(c)[:n]]
        kept |= set(level)
        for k in level:
            s[k] = s[int(tree.parent[k])] * p[k]
    return kept, widths


@pytest.mark.parametrize("expand,width", [(0.0, 8), (0.1, 3), (0.25, 2)])
def test_sampling_rule_replay_is_the_runtime_rule_and_its_monte_carlo(expand, width):
    """The replay's sampling rule equals `children` applied one round at a time, and its exact
    expected tokens per round equal a Monte-Carlo of the walk over the kept nodes."""
    rows = sampled_rows(12, seed=5)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    table = replay.rank_acceptance()
    rule = COSTS.rule(BRANCHING, expand, 1.2, width, table)  # rho: the verify cost counts
    result = replay.dynamic(rows["p"].to_numpy(), rule, COSTS)
    tree, rng = Tree(1, BRANCHING), np.random.default_rng(0)
    rounds, mc = Rounds(), 0.0
    for _, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        accept = {int(n): a for n, a in zip(rnd["node"], rnd["accept_prob"])}
        kept, widths = sampling_rule_round(rnd, rule, tree)
        exact = sum(accepted_probability(c, accept, tree) for c in kept)
        rounds.add(1 + exact, sum(COSTS.step[w] for w in widths) + COSTS.verify[1 + len(kept)],
                   1 + sum(accepted_probability(c, accept, tree) for c in accept))
        mc += 1 + walks(accept, kept, tree, 3000, rng)
    assert result.speedup == pytest.approx(rounds.speed(), rel=1e-12)
    assert result.tokens_per_round == pytest.approx(rounds.tokens_per_round(), rel=1e-12)
    assert mc / replay.rounds == pytest.approx(np.mean(rounds.tokens), abs=0.03)


def accepted_probability(node: int, accept: dict[int, float], tree: Tree) -> float:
    """P(node accepted): along its path, each node's acceptance with its earlier siblings
    rejected."""
    path = 1.0
    while node:
        up = int(tree.parent[node])
        earlier = [b for b in tree.children(up) if b < node]
        path *= accept[node] * np.prod([1 - accept[b] for b in earlier])
        node = up
    return path


def test_rank_acceptance_is_the_tested_weighted_rate_and_non_increasing():
    replay = TreeReplay.from_rows(sampled_rows(20, seed=6), BRANCHING)
    table = replay.rank_acceptance()
    assert [len(r) for r in table] == list(BRANCHING)
    assert all(a >= b for r in table for a, b in zip(r, r[1:]))
    first = (replay.level == 1) & (replay.tree.rank[replay.node].numpy() == 0)
    assert table[0][0] == pytest.approx(replay.gain[first].mean())  # tested every round


def test_the_sampling_rule_drafts_the_slots_that_pay_for_their_verification():
    """Slots by worth s * r; k maximises worth - rho * the verify cost added; none when the best
    gain does not exceed `expand`; the root keeps its first child."""
    cheap = (0.0, *(1.0 + 0.05 * n for n in range(12)))
    rule = TreeRule((3, 2), expand=0.1, rho=1.0, max_width=4, verify_cost=cheap, prune=False,
                    rank_accept=((0.5, 0.3, 0.2), (0.4, 0.1)))
    assert children(np.ones(1), 0, rule).tolist() == [3]
    s = np.array([0.6, 0.3, 0.1])  # worths 0.24 0.06 | 0.12 0.03 | 0.04 0.01; +0.05 per slot
    assert children(s, 1, rule, nodes=4).tolist() == [2, 1, 0]
    assert children(s, 1, replace(rule, expand=0.3), nodes=4).tolist() == [0, 0, 0]
    steep = (0.0, 1.0, 1.05, 1.1, 1.15, *(1.15 + 0.5 * n for n in range(1, 9)))
    assert children(s, 1, replace(rule, verify_cost=steep), nodes=4).tolist() == [0, 0, 0]
    assert children(np.ones(1), 0, replace(rule, expand=5.0)).tolist() == [1]


def chain_rows(rows: pd.DataFrame, seed: int) -> pd.DataFrame:
    """A lookup chain of 1-5 tokens in most rounds (LookupChains' columns): in half of them its
    first tokens retrace drafted nodes (their labels), the rest are tokens of its own accepted
    at random while the chain before them was; features drawn at random."""
    rng = np.random.default_rng(seed)
    out = []
    for (prompt_id, round_), rnd in rows.groupby(["prompt_id", "round"], sort=False):
        if rng.uniform() < 0.2:
            continue
        label_of = dict(zip(rnd["node"], rnd["label"]))
        children = rnd.groupby("parent")["node"].apply(list).to_dict()
        at, alive, retracing = 0, True, rng.uniform() < 0.5
        for j in range(1, int(rng.integers(1, 6)) + 1):
            if retracing and children.get(at) and rng.uniform() < 0.8:
                at = int(rng.choice(children[at]))
                token, label = 1000 + at, int(label_of[at])
            else:
                retracing, token = False, 5000 + j
                hit = alive and rng.uniform() < 0.7
                label = 1 if hit else 0 if alive else -1
            alive = label == 1
            out.append({"prompt_id": prompt_id, "round": round_, "split": "val", "token": token,
                        "label": label, "position": float(j), "ngram": float(rng.integers(1, 3)),
                        "log_gap": float(rng.uniform(0, 5)), "recent": float(rng.uniform())})
    return pd.DataFrame(out)


@pytest.mark.parametrize("gated_share", [0.0, 0.4])
@pytest.mark.parametrize("expand,rho,width,bias", [(0.0, 0.0, 8, 0.0), (0.3, 1.0, 2, 1.0),
                                                   (0.2, 0.7, 3, -1.5), (0.6, 2.5, 1, 3.0)])
def test_lookup_chain_replay_matches_the_runtime_rule_round_by_round(expand, rho, width, bias,
                                                                     gated_share):
    """The replay with a lookup branch (`LookupChains`, `TreeReplay.dynamic(chains=...)`) equals
    a round-by-round `verify_set` over the drafted candidates and the chain (the chain alone in
    the rounds gated off), by the chain's learned survival; a certain chain (survival 1) is
    scored the same way."""
    rows = superset_rows(40, seed=3)
    chains = chain_rows(rows, seed=4)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    logged = LookupChains.from_rows(chains, rows)
    rule = COSTS.rule(BRANCHING, expand, rho, width)
    model = LookupModel((-0.3, 0.2, -0.1, 1.0), bias)
    off = np.random.default_rng(5).uniform(size=replay.rounds) < gated_share
    keys = rows[["prompt_id", "round"]].drop_duplicates().itertuples(index=False)
    gated = frozenset(tuple(k) for k, o in zip(keys, off) if o)
    result = replay.dynamic(rows["p"].to_numpy(), rule, COSTS, off if gated else None, logged,
                            logged.survival(model))
    assert result.speedup == pytest.approx(reference(rows, rule, chains, model, gated).speed(),
                                           rel=1e-12)
    without = replay.dynamic(rows["p"].to_numpy(), rule, COSTS, off if gated else None)
    assert result.verified > without.verified  # some chain tokens are kept
    certain = replay.dynamic(rows["p"].to_numpy(), rule, COSTS, off if gated else None, logged,
                             logged.survival(None))
    assert certain.verified >= result.verified


def sampled_chain_rows(rows: pd.DataFrame, seed: int) -> pd.DataFrame:
    """Sampled rounds' chains as collect logs them (LookupChains' columns): 1-5 tokens in most
    rounds, in half of them the first ones retracing drafted nodes; each row's `accept_after`
    holds K + 1 chances, K the drafted children of its parent (0 below a token of its own)."""
    rng = np.random.default_rng(seed)
    out = []
    for (prompt_id, round_), rnd in rows.groupby(["prompt_id", "round"], sort=False):
        if rng.uniform() < 0.2:
            continue
        children = rnd.groupby("parent")["node"].apply(list).to_dict()
        at, retracing = 0, rng.uniform() < 0.5
        for j in range(1, int(rng.integers(1, 6)) + 1):
            k = len(children.get(at, [])) if at is not None else 0
            after = np.sort(rng.uniform(0, 1, k + 1))[::-1].tolist()
            if retracing and children.get(at) and rng.uniform() < 0.8:
                at = int(rng.choice(children[at]))
                token = 1000 + at
            else:
                retracing, at, token = False, None, 5000 + j
            out.append({"prompt_id": prompt_id, "round": round_, "split": "val",
                        "temperature": 0.7, "token": token, "label": -1, "position": float(j),
                        "ngram": float(rng.integers(1, 3)), "log_gap": float(rng.uniform(0, 5)),
                        "recent": float(rng.uniform()), "accept_after": after})
    return pd.DataFrame(out)


@pytest.mark.parametrize("expand,width,bias", [(0.0, 8, 0.0), (0.1, 3, 1.0), (0.25, 2, -1.5)])
def test_sampled_lookup_chain_replay_matches_the_runtime_rule_round_by_round(expand, width,
                                                                             bias):
    """Sampled rounds with a lookup branch: the sampling rule's tree one round at a time
    (`children`), the chain following its kept nodes and then below the last, the prefix of the
    rest `dynamic.verify_with_chain` keeps, scored by the chain's acceptances after the k kept
    children of its parent; the logged yield holds the whole chain as collect verified it."""
    rows = sampled_rows(30, seed=7)
    chains = sampled_chain_rows(rows, seed=8)
    logged = LookupChains.from_rows(chains, rows)
    replay = TreeReplay.from_rows(rows, BRANCHING, logged)
    rule = COSTS.rule(BRANCHING, expand, 1.2, width, replay.rank_acceptance())
    model = LookupModel((-0.3, 0.2, -0.1, 1.0), bias)
    result = replay.dynamic(rows["p"].to_numpy(), rule, COSTS, None, logged,
                            logged.survival(model))
    tree, rounds = Tree(1, BRANCHING), Rounds()
    for key, rnd in rows.groupby(["prompt_id", "round"], sort=False):
        accept = {int(n): a for n, a in zip(rnd["node"], rnd["accept_prob"])}
        kept, widths = sampling_rule_round(rnd, rule, tree)
        chain = chains[(chains["prompt_id"] == key[0]) & (chains["round"] == key[1])]
        gain, verified = chain_gain(chain, kept, set(accept), accept, tree, rule, model)
        everything, _ = chain_gain(chain, set(accept), set(accept), accept, tree, None, None)
        drafted = sum(accepted_probability(c, accept, tree) for c in kept)
        rounds.add(1 + drafted + gain,
                   sum(COSTS.step[w] for w in widths) + COSTS.verify[1 + len(kept) + verified],
                   1 + sum(accepted_probability(c, accept, tree) for c in accept) + everything)
    assert result.speedup == pytest.approx(rounds.speed(), rel=1e-12)
    assert result.tokens_per_round == pytest.approx(rounds.tokens_per_round(), rel=1e-12)
    without = replay.dynamic(rows["p"].to_numpy(), rule, COSTS)
    assert result.verified > without.verified  # some chain tokens are kept


def chain_gain(chain: pd.DataFrame, kept: set[int], logged: set[int], accept: dict[int, float],
               tree: Tree, rule: TreeRule | None, model: LookupModel | None
               ) -> tuple[float, int]:
    """(expected accepted chain tokens, chain tokens verified) of one sampled round verifying
    the drafted nodes `kept` of the `logged` ones: the chain follows kept nodes by token, the
    rest goes below the last (A), its prefix chosen by `dynamic.verify_with_chain` (`rule`
    None: all of it), its first token accepted with `accept_after[k]` (k: A's kept children)
    once A was and they were not, the next ones with `accept_after[0]`."""
    if not len(chain):
        return 0.0, 0
    tokens = chain["token"].tolist()
    at, m = 0, 0
    for token in tokens:
        node = token - 1000
        if node not in kept or int(tree.parent[node]) != at:
            break
        at, m = node, m + 1
    survival = np.ones(len(tokens)) if model is None else np.cumprod(
        model.probabilities(chain[list(LOOKUP_FEATURES)].to_numpy(np.float64)))
    if rule is None:
        c = len(tokens) - m
    else:
        _, rest, _ = verify_with_chain(np.zeros(len(kept)), np.full(len(kept), -1),
                                       np.full(len(kept), -1), LookupBranch(tokens, survival),
                                       rule.exact_under(greedy=False), list(range(m)))
        c = len(rest)
    kids = [b for b in tree.children(at) if b in kept]
    reach = (accepted_probability(at, accept, tree) if at else 1.0) \
        * np.prod([1 - accept[b] for b in kids])
    after = chain["accept_after"].tolist()
    gain, path = 0.0, reach
    for j in range(m, m + c):
        path *= after[j][len(kids)] if j == m else after[j][0]
        gain += path
    return gain, c


def test_expected_tokens_with_a_chain_are_the_verifiers_monte_carlo():
    """One sampled round of a static tree with its lookup chain (`lookup.with_chain`), scored
    from what collect logs of the whole tree (`verify.acceptance`, `chain_acceptance`), equals
    the mean accepted tokens of the exact verifier (`sampled_walk`) on sub-trees of it with the
    chain beside them: the chain retraced further or less, tested after fewer siblings."""
    vocab, branching = 9, (3, 2)
    gen = torch.Generator().manual_seed(0)
    full = Tree(1, branching)
    n = full.size(full.max_depth)
    q = torch.distributions.Dirichlet(torch.ones(vocab)).sample((full.size(1),))
    tokens = [0]
    for node in range(1, n):  # each node's children: distinct draws from its parent's q
        up = int(full.parent[node])
        taken = [tokens[c] for c in full.children(up) if c < node]
        weights = q[up].clone()
        weights[taken] = 0.0
        tokens.append(int(torch.multinomial(weights, 1, generator=gen)))
    proposal = Proposal(tokens=torch.tensor(tokens), depth=full.max_depth, root_position=0,
                        q=q, features=(), fed=torch.arange(n), steps=2, drafted=n - 1)
    below = [t for t in range(vocab) if t not in {tokens[c] for c in full.children(1)}]
    chain = [tokens[1], below[0], 4, 6]  # retraces node 1, then three tokens of its own
    merged, with_branch = with_chain(full, proposal, chain)
    paths = token_paths(merged, with_branch.tokens.tolist())
    p = {path: d for path, d in zip(paths, torch.distributions.Dirichlet(
        torch.ones(vocab)).sample((len(paths),)).double())}
    p_full = torch.stack([p[path] for path in paths])
    sampling = Sampling(1.0)
    accept = acceptance(merged, merged.max_depth, with_branch.tokens, p_full, with_branch.q,
                        sampling, True, with_branch.point)
    after = chain_acceptance(merged, with_branch.tokens, p_full, with_branch.q,
                             with_branch.point, chain, True)
    drafted = ~with_branch.point
    own = (torch.cumsum(drafted, 0) - 1)[drafted][1:]  # the drafted nodes' indices in `full`
    rows = pd.DataFrame({"prompt_id": "p", "temperature": 1.0, "round": 0,
                         "node": own.numpy(), "parent": (torch.cumsum(drafted, 0) - 1)[
                             merged.parent[drafted][1:]].numpy(),
                         "depth": merged.depth[drafted][1:].numpy(), "label": -1,
                         "token": with_branch.tokens[drafted][1:].numpy(),
                         "accept_prob": accept[drafted][1:].numpy()})
    logged = LookupChains.from_rows(pd.DataFrame(
        {"prompt_id": "p", "temperature": 1.0, "round": 0, "split": "val", "token": chain,
         "label": -1, "position": np.arange(1.0, 5.0), "ngram": 1.0, "log_gap": 0.0,
         "recent": 0.0, "accept_after": [a.tolist() for a in after]}), rows)
    replay = TreeReplay.from_rows(rows, branching, logged)
    for widths in [(3, 2), (2, 1), (1, 0)]:  # children kept at the root and below them: the
        # chain's own first token tested after 2, 1 and 0 siblings
        nodes = []
        for i in range(1, n):
            up = int(full.parent[i])
            if (up == 0 or up in nodes) and int(full.rank[i]) < widths[int(full.depth[i]) - 1]:
                nodes.append(i)
        kept = np.isin(rows["node"].to_numpy(), nodes)
        exact = replay.expected_tokens(kept, logged)[0]
        sub = Tree.from_parents(np.array([-1] + [nodes.index(int(full.parent[i])) + 1
                                                 if int(full.parent[i]) else 0 for i in nodes]))
        index = torch.tensor([0, *nodes])
        cut = Proposal(tokens=proposal.tokens[index], depth=sub.max_depth, root_position=0,
                       q=q[index[: sub.size(sub.max_depth - 1)]], features=(),
                       fed=torch.arange(len(index)), steps=sub.max_depth, drafted=len(nodes))
        tree, walked = with_chain(sub, cut, chain)
        p_sub = torch.stack([p[path] for path in token_paths(tree, walked.tokens.tolist())])
        u = torch.rand(4_000, tree.size(tree.max_depth), generator=gen, dtype=torch.float64)
        walks = np.array([len(sampled_walk(tree, tree.max_depth, walked.tokens, p_sub, walked.q,
                                           True, None, draws, walked.point)[0].path)
                          for draws in u])
        assert walks.mean() == pytest.approx(exact, abs=4.5 * walks.std() / np.sqrt(len(u))), \
            widths


def token_paths(tree: Tree, tokens: list[int]) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down: what the target's distribution there reads."""
    paths = []
    for node, token in enumerate(tokens):
        up = int(tree.parent[node])
        paths.append((*paths[up], token) if up >= 0 else (token,))
    return paths


def test_a_rule_that_does_not_prune_replays_a_lookup_branch_on_sampled_rounds_only():
    rows = superset_rows(5, seed=0)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    logged = LookupChains.from_rows(chain_rows(rows, seed=0), rows)
    rule = COSTS.rule(BRANCHING, 0.0, 1.0, 2, replay.rank_acceptance())
    with pytest.raises(ValueError, match="sampled rounds only"):
        replay.dynamic(rows["p"].to_numpy(), rule, COSTS, chains=logged,
                       chain_survival=logged.survival(None))
