"""Replay of tree policies on logged superset rounds: static shapes, Sequoia, dynamic trees, oracle.

Stage `collect` logs a superset tree per round: the top-k children of every node down to the
maximum depth (`collect.method: mcsd`, `mcsd_branching`, then chains).  Under greedy decoding a
node is accepted iff its parent is and its token is the target's argmax at the parent (label 1),
whatever else the tree holds, so one log scores every sub-tree of it exactly: a policy that
verifies the ancestor-closed set K yields 1 + |accepted in K| tokens and costs its draft steps
(one per level fed, at the width fed, decision latency included) plus one target pass over
1 + |K| tokens as the decode loop pays it, padding included, plus the host work of a drafted
round beyond `ar`'s (`TreeCosts`: the measured `CostCurve`'s prices and `CostModel.overhead`,
a static shape's round its own, a base and a term per level drafted, in `ar` steps).  Sampled
rounds are scored by their exact expected tokens given the drafted tree (the verification's
draws integrated out, not the one logged): each row's `accept_prob` is its exact
chance of acceptance given its parent was accepted and its earlier siblings were not, which does
not depend on later siblings, so for any K closed under parents and earlier siblings a round
yields 1 + sum over K of P(parent accepted) * prod over earlier siblings (1 - a) * a (`gain`);
a superset logged at the same temperature is the same draw for every sub-tree (the first k of
the draft's k' draws are its k draws).  Policies:

- static: a shape (children per node at levels 1, 2, 3, then 1; a depth), the same every round:
  chains (`sd`), `ti-mcsd` (3, 1, ...), `mcsd` (2, 2, ...) and every other shape of the grid;
- Sequoia (arXiv 2402.12374): the static tree of n nodes maximising the expected accepted
  tokens from acceptance-by-(depth, rank) statistics of the training rows (the n most likely
  nodes, closed under parents and earlier siblings), n tuned by replay;
- dynamic (`decoder.tree_rule`): per-node survival from a probability (the draft's own: EAGLE-2;
  a learned model), expand and verify as the runtime does, (expand, max_width) on a grid and
  rho by Dinkelbach's iteration; on sampled rounds every drafted node is verified, and the
  sampling rule (a child count per node from s * r[d][j], r fitted on sampled train rows) is
  tuned by `tune_sampling`;
- with a lookup branch: the logged lookup chains (`replay.lookup_chains`) join each round's
  candidates with their survivals (following the drafted rows it retraces, then below them);
  greedy, the verify set keeps what pays, as `dynamic.propose_tree` does; sampled, every
  drafted node is verified and the prefix of the rest of the chain that pays beside them, its
  first token tested after the k drafted children its parent keeps (its `accept_after[k]`),
  the others alone (`accept_after[0]`); a round gated off verifies the prefix of its chain that
  pays alone (`dynamic.propose_chain`).  Collect verified each sampled round's whole chain
  beside its superset, so the logged yield holds the chain's expected tokens;
- oracle: drafts and verifies exactly the accepted path, or nothing, knowing it in advance;
- `ar`: every round gated off (`gated`: the root alone, one one-token pass), speedup exactly 1;
  a round gate (`models.round_gate`) gates some rounds off before a dynamic tree drafts.

Every figure is a mean over the replayed run's rounds, weighted for where it starts them
(`simulate.run_means`: a logged round stands for the tokens the superset yielded there, a
replayed round passes the tokens it yields), as in `replay.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

import numpy as np
import pandas as pd

from specstop.decoder.costs import CostModel, RoundWork
from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule, children

from specstop.collection.data import ROUND_KEYS
from .lookup_chains import LookupChains
from .simulate import parent_rows, path_product, run_means

EXPAND_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)
WIDTH_GRID = (1, 2, 4, 8)


@dataclass(frozen=True)
class TreeCosts:
    """What a round pays, in `ar` steps (a one-token pass as the loop pays it)."""

    verify: np.ndarray  # [N + 1] pass over n tokens as the loop pays it (`CostCurve.prices`)
    step: np.ndarray  # [W + 1] draft step feeding w nodes, decision included (index 0: 0)
    round: RoundWork = RoundWork()  # a drafted round's host work outside its passes and
    # decisions, beyond ar's
    static_round: RoundWork = RoundWork()  # the same for a static shape's round (no per-level
    # selection)

    @classmethod
    def from_model(cls, costs: CostModel, nodes: int, widths: int, extra: float = 0.0,
                   sampled: bool = False) -> "TreeCosts":
        """`extra` seconds per decision (a learned model's latency) on top of the features';
        a drafted round's overhead (a dynamic tree's, a static one's) as measured for greedy or
        `sampled` rounds."""
        verify = costs.target.prices(nodes + 1)
        step = np.array([0.0] + [costs.draft_step(w, extra) for w in range(1, widths + 1)])
        return cls(verify, step, costs.overhead(sampled), costs.overhead(sampled, static=True))

    def rule(self, branching: tuple[int, ...], expand: float, rho: float, width: int,
             rank_accept: tuple[tuple[float, ...], ...] = ()) -> TreeRule:
        return TreeRule(branching, expand, rho, width, tuple(self.verify.tolist()),
                        rank_accept=rank_accept)


@dataclass(frozen=True)
class TreeResult:
    speedup: float  # tokens per target step of time, i.e. vs ar
    tokens_per_round: float
    verified: float  # mean nodes verified below the root
    draft_steps: float  # mean draft steps per round

    def as_dict(self) -> dict:
        return {"simulated_speedup": self.speedup, "tokens_per_call": self.tokens_per_round,
                "verified_nodes": self.verified, "draft_steps": self.draft_steps}


@dataclass(frozen=True)
class Tuned:
    name: str
    result: TreeResult
    setting: dict  # the shape, or the rule's expand, max_width, rho
    curve: list[tuple[float, float]]  # (mean verified nodes, speedup) over the budget swept


@dataclass(frozen=True)
class TreeReplay:
    """The logged superset rounds of one split, rows in tree order within each round."""

    tree: Tree  # the superset tree
    round_index: np.ndarray  # [n]
    level: np.ndarray  # [n] 1 = first drafted
    node: np.ndarray  # [n] index in `tree`
    parent_row: np.ndarray  # [n] -1 for children of the root
    sibling_group: np.ndarray  # [n] id of (round, parent)
    accepted: np.ndarray  # [n] bool, hard label 1
    cap: np.ndarray  # [R] deepest logged level
    sampled: bool  # sampled rounds: every drafted node is verified (`TreeRule.exact_under`)
    tested: np.ndarray  # [n] P(node tested | any policy verifying it, its ancestors and its
    # earlier siblings): greedy, labelled; sampled, exact from `accept_prob`
    gain: np.ndarray  # [n] P(node accepted), the same way: a round yields 1 + sum over the kept
    accept: np.ndarray  # [n] P(node accepted | parent accepted, earlier siblings rejected)
    logged: np.ndarray  # [R] tokens the logged round yielded, the whole superset verified (and,
    # sampled, its lookup chain)

    @classmethod
    def from_rows(cls, rows: pd.DataFrame, branching: tuple[int, ...],
                  chains: LookupChains | None = None) -> "TreeReplay":
        """Rows of one temperature; sampled rows are scored by their exact `accept_prob`, and
        their logged yield holds the `chains` collect verified beside them (their
        `LookupChains.from_rows` of these rows)."""
        round_index = rows.groupby(ROUND_KEYS, sort=False, observed=True).ngroup().to_numpy()
        node, parent = rows["node"].to_numpy().astype(np.int64), rows["parent"].to_numpy()
        level = rows["depth"].to_numpy().astype(np.int64)
        cap = np.zeros(round_index.max() + 1, dtype=np.int64)
        np.maximum.at(cap, round_index, level)
        tree = Tree(1, branching[: int(level.max())])
        groups = pd.Series(round_index * (len(tree.parent) + 1) + parent + 1).factorize()[0]
        parent_row, label = parent_rows(round_index, node, parent), rows["label"].to_numpy()
        sampled = "temperature" in rows and bool((rows["temperature"] > 0).any())
        if sampled:
            accept = rows["accept_prob"].to_numpy(np.float64)
            tested = _tested(accept, level, parent_row, groups)
            gain = tested * accept
        else:
            accept = (label == 1).astype(np.float64)
            tested, gain = (label >= 0).astype(np.float64), accept
        logged = 1 + np.bincount(round_index, gain, len(cap))
        replay = cls(tree, round_index, level, node, parent_row, groups, label == 1, cap, sampled,
                     tested, gain, accept, logged)
        if not sampled or chains is None:
            return replay
        return replace(replay, logged=replay.expected_tokens(np.ones(len(node), bool), chains))

    def expected_tokens(self, kept: np.ndarray, chains: LookupChains | None = None
                        ) -> np.ndarray:
        """[R] each round's expected tokens verifying the rows `kept` (closed under parents and
        earlier siblings) and, sampled with `chains`, the whole rest of each chain beside them
        (as collect verified it beside the superset)."""
        tokens = 1 + np.bincount(self.round_index, kept * self.gain, self.rounds)
        if chains is None:
            return tokens
        chained, gain = self._sampled_chain(kept, None, chains, None)
        return tokens + np.bincount(chains.round_index, chained * gain, self.rounds)

    @property
    def rounds(self) -> int:
        return len(self.cap)

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    # ---- scoring -------------------------------------------------------------------------

    def score(self, kept: np.ndarray, fed: np.ndarray, costs: TreeCosts,
              gated: np.ndarray | None = None, chains: LookupChains | None = None,
              chained: np.ndarray | None = None, chain_gain: np.ndarray | None = None
              ) -> TreeResult:
        """Replay: `kept` [n] verified rows, `fed` [R, max_depth] nodes fed per level (0: root),
        `chained` [m] the verified rows of `chains`, each yielding its `chain_gain` (greedy: its
        label); rounds `gated` [R] off draft nothing: the root and their `chained` rows (`ar`'s
        step without)."""
        if gated is not None:
            kept, fed = kept & ~gated[self.round_index], np.where(gated[:, None], 0, fed)
        verified = np.bincount(self.round_index, kept, self.rounds)
        tokens = 1 + np.bincount(self.round_index, kept * self.gain, self.rounds)
        if chains is not None:
            gain = chains.accepted if chain_gain is None else chain_gain
            verified += np.bincount(chains.round_index, chained, self.rounds)
            tokens += np.bincount(chains.round_index, chained * gain, self.rounds)
        levels = (fed > 0).sum(axis=1)
        cost = costs.step[fed].sum(axis=1) + costs.verify[1 + verified.astype(np.int64)] \
            + np.where(levels > 0, costs.round.at(levels), 0.0)
        return TreeResult(*run_means(tokens, cost, self.logged, verified, levels))

    def _fed_widths(self, fed_rows: np.ndarray, root: np.ndarray) -> np.ndarray:
        """[R, max_depth] nodes fed per level: the root (0/1), then the fed rows by level."""
        widths = np.zeros((self.rounds, self.max_depth), dtype=np.int64)
        widths[:, 0] = root
        rows = np.flatnonzero(fed_rows)
        np.add.at(widths, (self.round_index[rows], self.level[rows]), 1)
        return widths

    def static(self, nodes: np.ndarray, costs: TreeCosts) -> TreeResult:
        """A fixed ancestor-closed set of the superset tree's nodes ([N] bool) every round, a
        static round's host work charged (`TreeCosts.static_round`)."""
        kept = nodes[self.node]
        fed = np.zeros(len(kept), dtype=bool)
        inner = kept & (self.parent_row >= 0)
        fed[self.parent_row[inner]] = True
        root = np.bincount(self.round_index, kept & (self.level == 1), self.rounds) > 0
        static = replace(costs, round=costs.static_round)
        return self.score(kept, self._fed_widths(fed, root), static)

    def dynamic(self, p: np.ndarray, rule: TreeRule, costs: TreeCosts,
                gated: np.ndarray | None = None, chains: LookupChains | None = None,
                chain_survival: np.ndarray | None = None) -> TreeResult:
        """The runtime's rule (`decoder.tree_rule`) with per-row acceptance probabilities p, the
        rounds `gated` [R] off (`decoder.round_gate`) drafting nothing; greedy rounds with a
        lookup branch: `chains` and their rows' survivals (in a gated round the chain alone)."""
        rule = rule.exact_under(not self.sampled)
        s = path_product(p, self.level, self.parent_row)  # each row's survival
        if rule.rank_accept:
            kept, fed_rows = self._counted(s, rule)
            return self._scored(kept, fed_rows, costs, gated, rule, chains, chain_survival)
        candidate = self.level == 1
        fed = np.zeros(len(s), dtype=bool)
        for d in range(1, self.max_depth):
            room = d < self.cap[self.round_index]  # the budget allows another level
            ok = candidate & (self.level == d) & (s > rule.expand) & room & (d < rule.max_depth)
            fed |= ok & (_rank_within(self.round_index, s, ok) < rule.max_width)
            below = (self.level == d + 1) & (self.parent_row >= 0)
            candidate[below] = fed[self.parent_row[below]]
        if not rule.prune:
            return self._scored(candidate, fed, costs, gated, rule, chains, chain_survival)
        kept, chained = self._verify(s, candidate, rule, chains, chain_survival)
        if chains is not None and gated is not None:  # the chain alone
            _, alone = self._verify(s, np.zeros_like(candidate), rule, chains, chain_survival)
            chained = np.where(gated[chains.round_index], alone, chained)
        return self.score(kept, self._fed_widths(fed, np.ones(self.rounds, dtype=np.int64)),
                          costs, gated, chains, chained)

    def _scored(self, kept: np.ndarray, fed_rows: np.ndarray, costs: TreeCosts,
                gated: np.ndarray | None, rule: TreeRule, chains: LookupChains | None,
                chain_survival: np.ndarray | None) -> TreeResult:
        """A sampled round's score: the drafted rows `kept` (every one verified), and with
        `chains` the prefix of each chain that pays beside them (`_sampled_chain`)."""
        fed = self._fed_widths(fed_rows, np.ones(self.rounds, dtype=np.int64))
        if chains is None:
            return self.score(kept, fed, costs, gated)
        if not self.sampled:
            raise ValueError("a rule that does not prune replays a lookup branch on sampled "
                             "rounds only")
        drafted = kept if gated is None else kept & ~gated[self.round_index]
        chained, gain = self._sampled_chain(drafted, rule, chains, chain_survival)
        return self.score(kept, fed, costs, gated, chains, chained, gain)

    def _sampled_chain(self, kept: np.ndarray, rule: TreeRule | None, chains: LookupChains,
                       survival: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Sampled rounds verifying the drafted rows `kept` (closed under parents and earlier
        siblings): ([m] the chain rows verified, [m] each one's chance of acceptance), as
        `dynamic.verify_with_chain` chooses them: the chain follows the kept rows it retraces,
        the rest of it goes below the last of them (A, or the root), tested after A's k kept
        children, and `rule` keeps the prefix of the rest that maximises the sum of its
        `survival` - rho * the verify cost it adds (None: all of it, as collect verified it)."""
        rounds = chains.round_index
        hit = (chains.match >= 0) & kept[chains.match.clip(0)]
        retraced = pd.Series(hit).groupby(rounds).cummin().to_numpy(bool)
        attach = pd.Series(np.where(retraced, chains.match, -1)).groupby(
            rounds).cummax().to_numpy()  # A's row: deeper retraced rows come later
        slot = np.where(self.parent_row >= 0, self.parent_row, len(kept) + self.round_index)
        children = np.bincount(slot[kept], minlength=len(kept) + self.rounds)  # kept, by parent
        rejected = np.ones(len(kept) + self.rounds)  # P(every kept child rejected | parent)
        np.multiply.at(rejected, slot[kept], 1.0 - self.accept[kept])
        at = np.where(attach >= 0, attach, len(kept) + rounds)  # A's slot
        reached = np.where(attach >= 0, self.gain[attach.clip(0)], 1.0) * rejected[at]
        first = ~retraced & np.concatenate([[True], retraced[:-1] | (rounds[1:] != rounds[:-1])])
        width = chains.accept_after.shape[1]
        k = np.where(first, children[at], 0).clip(max=max(width - 1, 0))
        accept = np.nan_to_num(chains.accept_after[np.arange(len(rounds)), k]) if width \
            else np.zeros(len(rounds))
        rest = pd.Series(np.where(retraced, 1.0, accept))
        gain = np.where(retraced, 0.0, reached * rest.groupby(rounds).cumprod().to_numpy())
        if rule is None:
            return ~retraced, gain
        n = np.bincount(self.round_index[kept], minlength=self.rounds)[rounds]
        t = pd.Series(~retraced).groupby(rounds).cumsum().to_numpy()  # chain tokens up to here
        cost = np.asarray(rule.verify_cost)
        room = len(cost) - 2 - n  # the chain tokens the rule prices beside the drafted ones
        value = pd.Series(np.where(retraced, 0.0, survival)).groupby(rounds).cumsum().to_numpy() \
            - rule.rho * cost[np.minimum(1 + n + t, len(cost) - 1)]
        value = np.where(~retraced & (t <= room), value, -np.inf)
        best = np.full(self.rounds, -np.inf)
        np.maximum.at(best, rounds, value)
        nothing = -rule.rho * cost[np.minimum(1 + n, len(cost) - 1)]  # no chain token
        reaching = (value >= best[rounds]) & (best[rounds] > nothing)
        chosen = np.full(self.rounds, len(cost))
        np.minimum.at(chosen, rounds[reaching], t[reaching])  # the first, as argmax
        chosen[chosen == len(cost)] = 0
        return ~retraced & (t <= chosen[rounds]), gain

    def _counted(self, s: np.ndarray, rule: TreeRule) -> tuple[np.ndarray, np.ndarray]:
        """The sampling rule's tree of every round: ([n] rows drafted and verified, [n] rows
        fed), `tree_rule.children` level by level with the rounds as groups."""
        rank = self.tree.rank[self.node].numpy()
        counts = np.zeros(len(s), dtype=np.int64)  # children given to each row
        root = children(np.ones(self.rounds), 0, rule, np.arange(self.rounds))
        kept = (self.level == 1) & (rank < root[self.round_index])
        for d in range(1, self.max_depth):
            rows = np.flatnonzero(kept & (self.level == d) & (d < self.cap[self.round_index]))
            nodes = 1 + np.bincount(self.round_index[kept], minlength=self.rounds)
            counts[rows] = children(s[rows], d, rule, self.round_index[rows], nodes)
            below = np.flatnonzero((self.level == d + 1) & (self.parent_row >= 0))
            up = self.parent_row[below]
            kept[below] = kept[up] & (rank[below] < counts[up])
        return kept, counts > 0

    def rank_acceptance(self) -> tuple[tuple[float, ...], ...]:
        """r[d][j]: the chance the j-th child at level d + 1 is accepted when tested (weighted by
        how likely the test is), made non-increasing in j: the sampling rule's table."""
        rank = self.tree.rank[self.node].numpy()
        table = []
        for d, width in enumerate(self.tree.branching, start=1):
            at = [(self.level == d) & (rank == j) for j in range(width)]
            rate = [self.gain[a].sum() / max(self.tested[a].sum(), 1e-12) for a in at]
            table.append(tuple(float(x) for x in np.minimum.accumulate(rate)))
        return tuple(table)

    def _verify(self, s: np.ndarray, candidate: np.ndarray, rule: TreeRule,
                chains: LookupChains | None = None, chain_survival: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """`tree_rule.verify_set` of every round at once: the n best candidates by the closed
        survival, n maximising sum(s) - rho * verify_cost[1 + n]: ([n] kept rows, [m] kept rows
        of `chains`, empty without).  A chain's rows that retrace candidates (`match`) are
        those candidates, with the larger of the two survivals; the rest of it are candidates
        below the last of them (or the root), after the drafted ones
        (`dynamic.verify_with_chain`)."""
        if chains is not None:
            hit = (chains.match >= 0) & candidate[chains.match.clip(0)]
            retraced = pd.Series(hit).groupby(chains.round_index).cummin().to_numpy(bool)
            s = s.copy()
            np.maximum.at(s, chains.match[retraced], chain_survival[retraced])
            attach = pd.Series(np.where(retraced, chains.match, -1)).groupby(
                chains.round_index).cummax().to_numpy()  # the last retraced row: deeper rows
            # come later in tree order
        key = np.where(candidate, s, -np.inf)
        for d in range(1, self.max_depth + 1):
            rows = np.flatnonzero(self.level == d)
            inner = rows[self.parent_row[rows] >= 0]
            key[inner] = np.minimum(key[inner], key[self.parent_row[inner]])
            key[rows] = pd.Series(key[rows]).groupby(self.sibling_group[rows]).cummin().to_numpy()
        rows = np.flatnonzero(candidate)
        ids, keys, rounds, survival = rows, key[rows], self.round_index[rows], s[rows]
        if chains is not None:  # a chain's survival never rises along it: closed below its
            # attachment
            rest = np.flatnonzero(~retraced)
            closed = np.minimum(chain_survival, np.where(attach >= 0, key[attach.clip(0)], np.inf))
            ids = np.concatenate([ids, len(s) + rest])
            keys = np.concatenate([keys, closed[rest]])
            rounds = np.concatenate([rounds, chains.round_index[rest]])
            survival = np.concatenate([survival, chain_survival[rest]])
        order = np.lexsort((ids, -keys, rounds))
        rounds = rounds[order]
        position = pd.Series(rounds).groupby(rounds).cumcount().to_numpy() + 1
        gain = pd.Series(survival[order]).groupby(rounds).cumsum().to_numpy()
        cost = np.array([rule.cost(1 + k) for k in range(int(position.max(initial=0)) + 1)])
        # cost[k]: a pass over the root and k nodes
        value = gain - rule.rho * cost[position]
        nothing = -rule.rho * rule.cost(1)  # the root alone
        best = np.full(self.rounds, nothing)
        np.maximum.at(best, rounds, value)
        hit = value >= best[rounds]  # the first n reaching the best, as np.argmax
        first = np.full(self.rounds, np.iinfo(np.int64).max)
        np.minimum.at(first, rounds[hit], position[hit])
        chosen = np.where(best > nothing, first, 0)
        kept = np.zeros(len(s) + (0 if chains is None else len(chains)), dtype=bool)
        kept[ids[order[position <= chosen[rounds]]]] = True
        return kept[: len(s)], kept[len(s):]

    def oracle(self, costs: TreeCosts, iterations: int = 10) -> TreeResult:
        """Per round, the prefix of the accepted path (or nothing) maximising tokens - rho *
        cost, rho the resulting speed (Dinkelbach): the bound no policy on these rounds beats."""
        accepted = np.bincount(self.round_index, self.accepted, self.rounds).astype(np.int64)
        k = np.arange(self.max_depth + 1)
        cost = np.where(k == 0, costs.verify[1],
                        k * costs.step[1] + costs.verify[1 + k] + costs.round.at(k))
        rho = 1.0
        for _ in range(iterations):
            value = np.where(k[None, :] <= accepted[:, None], k + 1 - rho * cost[None, :], -np.inf)
            choice = np.argmax(value, axis=1)
            result = TreeResult(*run_means(choice + 1.0, cost[choice], self.logged, choice,
                                           choice))
            rho = result.speedup
        return result


def _tested(accept: np.ndarray, level: np.ndarray, parent_row: np.ndarray,
            sibling_group: np.ndarray) -> np.ndarray:
    """[n] P(node tested) from each row's exact acceptance at its parent: its parent accepted
    and every earlier sibling rejected (siblings in rank order; the first candidates' tests do
    not depend on later ones, so this holds for any policy verifying a prefix of children)."""
    rejected = pd.Series(1.0 - accept).groupby(sibling_group).cumprod()
    tested = rejected.groupby(sibling_group).shift(1, fill_value=1.0).to_numpy(copy=True)
    for d in range(2, int(level.max(initial=1)) + 1):
        rows = np.flatnonzero((level == d) & (parent_row >= 0))
        up = parent_row[rows]
        tested[rows] *= tested[up] * accept[up]
    return tested


def _rank_within(groups: np.ndarray, score: np.ndarray, among: np.ndarray) -> np.ndarray:
    """[n] rank of each row `among` its group by score (descending, ties by index); others big."""
    rows = np.flatnonzero(among)
    order = rows[np.lexsort((rows, -score[rows], groups[rows]))]
    rank = np.full(len(score), np.iinfo(np.int64).max)
    rank[order] = pd.Series(groups[order]).groupby(groups[order]).cumcount().to_numpy()
    return rank


# ---- policies ------------------------------------------------------------------------------


def shape_nodes(tree: Tree, widths: tuple[int, ...], depth: int) -> np.ndarray:
    """[N] bool: the superset nodes of a static shape (children per node at levels 1..len(widths),
    then 1) cut at `depth`."""
    limit = [widths[d - 1] if d <= len(widths) else 1 for d in range(1, tree.max_depth + 1)]
    ok = np.zeros(len(tree.parent), dtype=bool)
    ok[0] = True
    for i in range(1, len(tree.parent)):
        d = int(tree.depth[i])
        ok[i] = ok[int(tree.parent[i])] and int(tree.rank[i]) < limit[d - 1] and d <= depth
    return ok


def best_static(replay: TreeReplay, costs: TreeCosts) -> dict[str, Tuned]:
    """The fastest chain (`sd`), `ti-mcsd`-like and general shape of the grid."""
    branching = replay.tree.branching
    grid = [(w1, w2, w3) for w1 in range(1, branching[0] + 1)
            for w2 in range(1, (branching[1] if len(branching) > 1 else 1) + 1)
            for w3 in range(1, (branching[2] if len(branching) > 2 else 1) + 1)]
    depths = range(1, replay.max_depth + 1)
    results = {(w, d): replay.static(shape_nodes(replay.tree, w, d), costs)
               for w in grid for d in depths}

    def best(name: str, shapes: list[tuple[tuple[int, ...], int]]) -> Tuned:
        (w, d) = max(shapes, key=lambda s: results[s].speedup)
        curve = sorted((results[s].verified, results[s].speedup) for s in shapes)
        return Tuned(name, results[(w, d)], {"widths": list(w), "depth": d}, curve)

    chains = [((1, 1, 1), d) for d in depths]
    ti = [((w, 1, 1), d) for w in range(2, branching[0] + 1) for d in depths]
    out = {"static_chain": best("static_chain", chains), "static_tree": best("static_tree",
                                                                             list(results))}
    if ti:
        out["static_ti_mcsd"] = best("static_ti_mcsd", ti)
    return out


def sequoia(replay: TreeReplay, train: TreeReplay, costs: TreeCosts) -> Tuned:
    """The Sequoia static tree: node value = product of acceptance by (depth, rank) along its
    path (training rows), the n best nodes (closed under parents and earlier siblings)."""
    tree = replay.tree
    labelled = train.parent_row < 0
    labelled |= train.accepted[np.clip(train.parent_row, 0, None)] & (train.parent_row >= 0)
    rank, depth = tree.rank[train.node].numpy(), train.level
    table = pd.DataFrame({"d": depth[labelled], "r": rank[labelled],
                          "a": train.accepted[labelled]}).groupby(["d", "r"])["a"].mean()
    value = np.ones(len(tree.parent))
    for i in range(1, len(tree.parent)):
        d, r = int(tree.depth[i]), int(tree.rank[i])
        value[i] = value[int(tree.parent[i])] * table.get((d, r), 0.0)
        if r > 0:
            value[i] = min(value[i], value[i - 1])  # an earlier sibling first
    order = np.lexsort((np.arange(len(value)), -value))
    results = []
    for n in range(1, len(value)):
        nodes = np.zeros(len(value), dtype=bool)
        nodes[order[: n + 1]] = True  # the root and n nodes
        results.append((n, replay.static(nodes, costs)))
    n, result = max(results, key=lambda r: r[1].speedup)
    return Tuned("sequoia", result, {"nodes": n},
                 [(r.verified, r.speedup) for _, r in results])


def tune_dynamic(name: str, replay: TreeReplay, p: np.ndarray, costs: TreeCosts,
                 start_rho: float, iterations: int = 4) -> tuple[Tuned, TreeRule]:
    """(expand, max_width, depth: the superset's levels kept) over the grid, rho by Dinkelbach
    from `start_rho`; the curve sweeps rho (the node budget) at the best of them."""
    widths = [w for w in WIDTH_GRID if w < len(costs.step)]
    branching = replay.tree.branching
    best: tuple[TreeResult, TreeRule] | None = None
    for expand, width, depth in product(EXPAND_GRID, widths, range(1, len(branching) + 1)):
        rho = start_rho
        for _ in range(iterations):
            rule = costs.rule(branching[:depth], expand, rho, width)
            result = replay.dynamic(p, rule, costs)
            if best is None or result.speedup > best[0].speedup:
                best = (result, rule)
            if abs(result.speedup - rho) < 1e-6:
                break
            rho = result.speedup
    result, rule = best
    curve = []
    for factor in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0):
        swept = replay.dynamic(p, costs.rule(rule.branching, rule.expand, rule.rho * factor,
                                             rule.max_width), costs)
        curve.append((swept.verified, swept.speedup))
    setting = {"expand": rule.expand, "max_width": rule.max_width, "rho": rule.rho,
               "depth": rule.max_depth}
    return Tuned(name, result, setting, sorted(curve)), rule


def tune_sampling(name: str, replay: TreeReplay, p: np.ndarray, costs: TreeCosts,
                  rank_accept: tuple[tuple[float, ...], ...], start_rho: float,
                  iterations: int = 4) -> tuple[Tuned, TreeRule]:
    """The sampling rule (`tree_rule.children`) on sampled rounds, scored by exact expected
    tokens: (expand, max_width) over the grid, rho by Dinkelbach's iteration from `start_rho`;
    the curve sweeps expand at the best max_width."""
    widths = [w for w in WIDTH_GRID if w < len(costs.step)]
    results: dict[tuple[float, int], tuple[TreeResult, TreeRule]] = {}
    for expand in EXPAND_GRID:
        for width in widths:
            rho = start_rho
            for _ in range(iterations):
                rule = costs.rule(replay.tree.branching, expand, rho, width, rank_accept)
                result = replay.dynamic(p, rule, costs)
                if (expand, width) not in results \
                        or result.speedup > results[(expand, width)][0].speedup:
                    results[(expand, width)] = (result, rule)
                if abs(result.speedup - rho) < 1e-6:
                    break
                rho = result.speedup
    expand, width = max(results, key=lambda k: results[k][0].speedup)
    result, rule = results[(expand, width)]
    curve = sorted((results[(e, width)][0].verified, results[(e, width)][0].speedup)
                   for e in EXPAND_GRID)
    return Tuned(name, result, {"expand": expand, "max_width": width, "rho": rule.rho}, curve), rule
