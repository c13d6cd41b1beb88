"""Exact enumeration of the verification rules (VERIFICATION.md §1-2, §5.1), float64, tol 1e-10.

Nothing is sampled.  The rules take their uniforms from `ScriptedUniform`, which answers each
test accept (u = -inf) or reject (u = inf) from a script, and report back the thresholds of the
tests they made.  A depth-first search over the scripts visits every accept/reject branch once
and weighs it by its exact probability (min(1, t) to accept, 1 - min(1, t) to reject, for a
continuous u ~ U[0, 1)).  Summing the emitted token's distribution over all branches and over
all candidate tuples (weighted by how the drafter draws them) must give back p.  The `tree`
method's dynamic trees are enumerated the same way, over every pick of candidates
(`ScriptedChildren`), through the real `propose_tree`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterator, TypeVar

import pytest
import torch

import specstop.decoder.drafter as drafter
import specstop.decoder.verify as verify
from specstop.decoder.contracts import Proposal
from specstop.decoder.costs import CostCurve
from specstop.decoder.dynamic import propose_tree
from specstop.decoder.lookup import with_lookup_branch
from specstop.decoder.policy import ConfidenceTree
from specstop.decoder.sampling import Sampling
from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule
from specstop.decoder.verify import Support, Verdict, mcss, residual, sampled_walk, verify_tree
from specstop.features import RoundContext, root_statistics

TOL = 1e-10
R = TypeVar("R")


# ---------------------------------------------------------------------------------------------
# Helpers: distributions, candidate tuples, scripted uniforms.


def random_dist(v: int, seed: int, zeros: int = 0, spread: float = 1.5) -> torch.Tensor:
    """[v] float64 distribution with `zeros` entries set to 0 (as after top-p truncation)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.exp(spread * torch.randn(v, generator=g, dtype=torch.float64))
    probs[torch.randperm(v, generator=g)[:zeros]] = 0.0
    return probs / probs.sum()


def one_hot(x: int, v: int) -> torch.Tensor:
    out = torch.zeros(v, dtype=torch.float64)
    out[x] = 1.0
    return out


def iid_tuples(q: torch.Tensor, k: int) -> Iterator[tuple[tuple[int, ...], float]]:
    """Every k-tuple drawn i.i.d. from q, with its probability (zero-probability ones omitted)."""
    support = [x for x in range(q.shape[0]) if q[x] > 0]
    for xs in itertools.product(support, repeat=k):
        yield xs, math.prod(float(q[x]) for x in xs)


def wor_tuples(q: torch.Tensor, k: int) -> Iterator[tuple[tuple[int, ...], float]]:
    """Sequential draws without replacement from the renormalised rest.  Once q's support is
    used up, the remaining slots are padded with the lowest unused ids (q = 0 there), as the
    Gumbel-top-k drafter pads them with arbitrary q = 0 ids."""

    def rec(prefix: tuple[int, ...], prob: float) -> Iterator[tuple[tuple[int, ...], float]]:
        if len(prefix) == k:
            yield prefix, prob
            return
        rest = [x for x in range(q.shape[0]) if x not in prefix]
        mass = sum(float(q[x]) for x in rest)
        if mass <= 0:
            yield from rec(prefix + (rest[0],), prob)
            return
        for x in rest:
            if q[x] > 0:
                yield from rec(prefix + (x,), prob * float(q[x]) / mass)

    yield from rec((), 1.0)


def candidate_tuples(q: torch.Tensor, k: int, wor: bool) -> list[tuple[tuple[int, ...], float]]:
    tuples = list((wor_tuples if wor else iid_tuples)(q, k))
    assert abs(sum(prob for _, prob in tuples) - 1.0) < TOL
    return tuples


class ScriptedUniform:
    """The uniforms of a rule's tests, from a script: a list of (uniform id, accept?) for the
    first tests made, ids counted across every `draw` since `start`; every other test rejects.
    A rule given `draw(n)` reports the [n] thresholds of the tests it made (nan elsewhere)."""

    def start(self, script: list[tuple[int, bool]]) -> None:
        self.script, self.drawn, self.reported = script, 0, []
        self.accept = {i for i, ok in script if ok}

    def draw(self, n: int) -> torch.Tensor:
        ids = range(self.drawn, self.drawn + n)
        self.drawn += n
        return torch.tensor([-math.inf if i in self.accept else math.inf for i in ids],
                            dtype=torch.float64)

    def report(self, made: torch.Tensor) -> None:
        self.reported.append(made)

    def tests(self) -> tuple[list[int], list[float]]:
        """(ids, thresholds) of the tests made, in order."""
        made = torch.cat(self.reported) if self.reported else torch.zeros(0)
        assert made.shape[0] == self.drawn, "every draw is reported"
        ids = (~made.isnan()).nonzero().flatten().tolist()
        return ids, made[ids].tolist()


@pytest.fixture
def scripted() -> ScriptedUniform:
    return ScriptedUniform()


def scripted_mcss(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor, cands: list[int],
                  wor: bool) -> tuple[int, torch.Tensor]:
    """`mcss` on scripted uniforms: (index of the accepted candidate or -1, its distribution)."""
    index, dist, made = mcss(p, q, cands, wor, u.draw(len(cands)))
    u.report(made)
    return int(index), dist


def scripted_walk(u: ScriptedUniform, tree: Tree, depth: int, ids: torch.Tensor,
                  p: torch.Tensor, q: torch.Tensor, wor: bool, eos_id: int | None,
                  support: Support | None = None) -> Verdict:
    """`sampled_walk` (`verify_tree` when sampling) on scripted uniforms."""
    verdict, made = sampled_walk(tree, depth, ids, p, q, wor, eos_id, u.draw(ids.shape[0]),
                                 support=support)
    u.report(made)
    return verdict


def accept_prob(threshold: float) -> float:
    """P(u < t) for u ~ U[0, 1)."""
    return min(1.0, max(0.0, threshold))


Branch = tuple[float, list[bool], list[float], R]


def branches(u: ScriptedUniform, run: Callable[[], R]) -> list[Branch]:
    """Every accept/reject branch of `run`: (exact probability, decisions, thresholds, result)."""
    leaves, stack = [], [[]]
    while stack:
        script = stack.pop()
        u.start(script)
        result = run()
        tests, thresholds = u.tests()
        assert tests[:len(script)] == [i for i, _ in script]
        decisions = [ok for _, ok in script] + [False] * (len(tests) - len(script))
        prob = math.prod(accept_prob(t) if d else 1.0 - accept_prob(t)
                         for t, d in zip(thresholds, decisions))
        leaves.append((prob, decisions, thresholds, result))
        for j in range(len(script), len(decisions)):
            if accept_prob(thresholds[j]) > 0:  # accepting there has probability 0 otherwise
                stack.append(list(zip(tests[:j], decisions[:j])) + [(tests[j], True)])
    return leaves


def reference_thresholds(p: torch.Tensor, q: torch.Tensor, cands: tuple[int, ...], wor: bool,
                         decisions: list[bool]) -> list[float]:
    """The tests §2's `mcss` pseudo-code makes along `decisions`: p(x)/q̄(x) per tested x."""
    p, q_bar, out = p.clone(), q.clone(), []
    for x in cands:
        if q_bar[x] <= 0:  # could not have been drawn (a repeat or padding without replacement)
            continue
        out.append(float(p[x] / q_bar[x]))
        if decisions[len(out) - 1]:
            break
        r = (p - q_bar).clamp_min(0.0)
        p = r / r.sum() if r.sum() >= verify.RESIDUAL_FLOOR else p
        if wor:
            q_bar[x] = 0.0
            if q_bar.sum() <= 0:
                break
            q_bar = q_bar / q_bar.sum()
    return out


def mcss_output(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor, cands: tuple[int, ...],
                wor: bool) -> torch.Tensor:
    """[V] exact distribution of the token `mcss` emits for fixed candidates; also checks every
    branch's tests against `reference_thresholds` and that each residual is a distribution."""
    out = torch.zeros_like(p)
    for prob, decisions, thresholds, (index, dist) in branches(
            u, lambda: scripted_mcss(u, p.clone(), q.clone(), list(cands), wor)):
        reference = reference_thresholds(p, q, cands, wor, decisions)
        assert len(thresholds) == len(reference)
        assert all(abs(a - b) <= 1e-12 * max(1.0, b) for a, b in zip(thresholds, reference))
        if index >= 0:
            assert decisions[-1]
            out[cands[index]] += prob
        else:
            assert not any(decisions)
            assert dist.min() >= 0 and abs(float(dist.sum()) - 1.0) < TOL
            out += prob * dist
    return out


def emitted_distribution(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor, k: int,
                         wor: bool) -> torch.Tensor:
    """[V] distribution of `mcss`'s emitted token, summed over every candidate tuple."""
    total = torch.zeros_like(p)
    for cands, prob in candidate_tuples(q, k, wor):
        total += prob * mcss_output(u, p, q, cands, wor)
    return total


# ---------------------------------------------------------------------------------------------
# residual


@pytest.mark.parametrize("seed", range(5))
def test_residual_is_the_normalised_positive_part(seed: int) -> None:
    p, q = random_dist(6, seed, zeros=seed % 3), random_dist(6, 100 + seed, zeros=1)
    r = residual(p, q)
    expected = (p - q).clamp_min(0.0)
    assert r.min() >= 0 and abs(float(r.sum()) - 1.0) < TOL
    assert torch.allclose(r, expected / expected.sum(), atol=TOL, rtol=0)
    assert torch.all(r[p <= q] == 0)


def test_residual_falls_back_to_p_when_p_equals_q() -> None:
    p = random_dist(5, 0)
    assert torch.equal(residual(p, p.clone()), p)
    nudged = p.clone()
    nudged[0] -= 1e-14  # mass of max(p - q, 0) below 1e-12: rounding noise, not a distribution
    nudged[1] += 1e-14
    assert torch.equal(residual(p, nudged), p)


def test_residual_against_a_one_hot_zeroes_that_token() -> None:
    """vLLM's no-draft-probs rule: res(p, onehot(x)) = p without x, renormalised."""
    p = random_dist(6, 1)
    expected = p.clone()
    expected[2] = 0.0
    assert torch.allclose(residual(p, one_hot(2, 6)), expected / expected.sum(), atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# mcss: exact enumeration over candidate tuples and accept/reject branches

def disjoint(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p on the first half of the vocabulary, q on the rest: nothing can be accepted."""
    half = torch.arange(v) < (v + 1) // 2
    p, q = random_dist(v, seed) * half, random_dist(v, seed + 50) * ~half
    return p / p.sum(), q / q.sum()


CASES: dict[str, Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "dense": lambda v, s: (random_dist(v, s), random_dist(v, s + 50)),
    "truncated": lambda v, s: (random_dist(v, s, zeros=v // 3),
                               random_dist(v, s + 50, zeros=v // 2)),
    "q_equals_p": lambda v, s: (random_dist(v, s),) * 2,
    "disjoint": disjoint,
    "one_hot_p": lambda v, s: (one_hot(v - 1, v), random_dist(v, s + 50)),
}


SIZES = [(v, k, wor) for v in (2, 4, 6) for k in (1, 2, 3) for wor in (False, True)
         if k <= v or not wor]  # k distinct draws need k <= V


@pytest.mark.parametrize("v,k,wor", SIZES, ids=[f"V{v}-k{k}-{'wor' if w else 'wr'}"
                                                 for v, k, w in SIZES])
@pytest.mark.parametrize("case", list(CASES))
def test_mcss_emits_p_exactly(scripted: ScriptedUniform, case: str, v: int, k: int,
                              wor: bool) -> None:
    for seed in range(2):
        p, q = CASES[case](v, seed)
        emitted = emitted_distribution(scripted, p, q, k, wor)
        assert torch.allclose(emitted, p, atol=TOL, rtol=0), (case, seed, emitted, p)


def removed_before_residual(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor,
                            cands: list[int]) -> tuple[int, torch.Tensor]:
    """A wrong `mcss` (without replacement): zeroes x in q̄ BEFORE taking the residual."""
    draws, made = u.draw(len(cands)), torch.full((len(cands),), math.nan, dtype=torch.float64)
    q_bar, result = q.clone(), None
    for i, x in enumerate(cands):
        made[i] = p[x] / q_bar[x]
        if draws[i] < made[i]:
            result = i, p
            break
        q_bar[x] = 0.0
        q_bar = q_bar / q_bar.sum()
        p = residual(p, q_bar)
    u.report(made)
    return result or (-1, p)


def test_enumeration_detects_the_wrong_residual_order(scripted: ScriptedUniform) -> None:
    """The harness can fail: the slip §2 warns about does not give p."""
    p, q = random_dist(5, 3), random_dist(5, 4)
    total = torch.zeros_like(p)
    for cands, prob in candidate_tuples(q, 2, wor=True):
        for leaf_prob, _, _, (index, dist) in branches(
                scripted, lambda: removed_before_residual(scripted, p, q, list(cands))):
            total += prob * leaf_prob * (one_hot(cands[index], 5) if index >= 0 else dist)
    assert abs(float(total.sum()) - 1.0) < TOL
    assert (total - p).abs().max() > 1e-3


def test_mcss_decision_boundary_is_strict_u_below_p_over_q() -> None:
    """The first candidate x is accepted for u just below min(1, p(x)/q(x)) and rejected at
    u = p(x)/q(x); u = 0 never accepts a token the target gives probability 0."""
    p, q = random_dist(5, 7, zeros=1), random_dist(5, 8)
    assert (p == 0).any() and (p > q).any()
    for x in range(5):
        t = float(p[x] / q[x])
        cases = [(math.nextafter(min(t, 1.0), 0.0), t > 0)] + ([(t, False)] if t < 1 else [])
        for u, accepted in cases:
            index, _, _ = mcss(p.clone(), q.clone(), [x], False,
                               torch.tensor([u], dtype=torch.float64))
            assert (int(index) == 0) == accepted, (x, t, u)


def test_without_replacement_skips_candidates_that_could_not_be_drawn(
        scripted: ScriptedUniform) -> None:
    """A repeat (q̄ = 0 once rejected) and padding beyond q's support (q = 0) are never tested."""
    p = random_dist(4, 9)
    q = torch.tensor([0.6, 0.4, 0.0, 0.0], dtype=torch.float64)
    scripted.start([])
    index, dist = scripted_mcss(scripted, p, q, [1, 1, 3, 0], True)
    assert index == -1 and scripted.tests()[0] == [0, 3]
    assert dist.min() >= 0 and abs(float(dist.sum()) - 1.0) < TOL


# ---------------------------------------------------------------------------------------------
# Deterministic candidates (draft top-k, n-grams): mcss with a one-hot q per candidate


def deterministic_output(u: ScriptedUniform, p: torch.Tensor, cands: list[int],
                         q_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """[V] emitted distribution when candidate i is tested with q_of(i), one mcss step each,
    carrying the residual from one candidate to the next."""

    def run() -> tuple[int, torch.Tensor]:
        dist = p.clone()
        for i, x in enumerate(cands):
            index, dist = scripted_mcss(u, dist, q_of(i), [x], True)
            if index == 0:
                return x, dist
        return -1, dist

    out = torch.zeros_like(p)
    for prob, _, _, (token, dist) in branches(u, run):
        out += prob * (one_hot(token, p.shape[0]) if token >= 0 else dist)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_deterministic_candidates_with_one_hot_q_give_p(scripted: ScriptedUniform, k: int,
                                                        seed: int) -> None:
    v = 6
    p = random_dist(v, seed, zeros=seed % 2)
    cands = random_dist(v, 60 + seed).topk(k).indices.tolist()  # the draft's top-k
    out = deterministic_output(scripted, p, cands, lambda i: one_hot(cands[i], v))
    assert torch.allclose(out, p, atol=TOL, rtol=0)


def emitted_distribution_fixed(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor,
                               cands: tuple[int, ...]) -> torch.Tensor:
    """Like `mcss_output` without the reference check: q need not be what `cands` came from."""
    out = torch.zeros_like(p)
    for prob, _, _, (index, dist) in branches(
            u, lambda: scripted_mcss(u, p, q, list(cands), True)):
        out += prob * (one_hot(cands[index], p.shape[0]) if index >= 0 else dist)
    return out


def test_soft_top_k_q_with_deterministic_candidates_is_biased(scripted: ScriptedUniform) -> None:
    """Negative control (§2): q = softmax of the draft's top-k logits is not what the
    deterministic candidates were drawn from; with a sampling target the output is biased."""
    v, k = 6, 2
    p, draft = random_dist(v, 11), random_dist(v, 12)
    cands = draft.topk(k).indices.tolist()
    soft = torch.zeros(v, dtype=torch.float64)
    soft[cands] = draft[cands] / draft[cands].sum()
    out = emitted_distribution_fixed(scripted, p, soft, tuple(cands))
    assert abs(float(out.sum()) - 1.0) < TOL
    assert (out - p).abs().max() > 0.01


def point_output(u: ScriptedUniform, p: torch.Tensor, q: torch.Tensor, cands: tuple[int, ...],
                 wor: bool, point: bool) -> torch.Tensor:
    """[V] exact distribution `mcss` emits for drawn candidates followed by one more, marked as
    a point mass (`point`) or not."""
    flags = torch.tensor([False] * (len(cands) - 1) + [point])

    def run() -> tuple[int, torch.Tensor]:
        index, dist, made = mcss(p.clone(), q.clone(), list(cands), wor, u.draw(len(cands)),
                                 point=flags)
        u.report(made)
        return int(index), dist

    out = torch.zeros_like(p)
    for prob, _, _, (index, dist) in branches(u, run):
        out += prob * (one_hot(cands[index], p.shape[0]) if index >= 0 else dist)
    return out


@pytest.mark.parametrize("k,wor", [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("seed", range(3))
def test_a_point_candidate_after_the_drawn_ones_gives_p(scripted: ScriptedUniform, k: int,
                                                        wor: bool, seed: int) -> None:
    """A lookup chain's node beside drawn children (`mcss(point=...)`): tested after them with
    u < p'(x), p' the residual they leave, then p' without x.  Whatever chose x (here a function
    of the drawn candidates: the first token none of them is, or the first of them) the emitted
    token is distributed as p; testing x against the drawn q̄ instead is biased."""
    v = 5
    p, q = random_dist(v, seed, zeros=seed % 2), random_dist(v, 40 + seed)

    def emitted(choose: Callable[[tuple[int, ...]], int], point: bool) -> torch.Tensor:
        total = torch.zeros_like(p)
        for cands, prob in candidate_tuples(q, k, wor):
            total += prob * point_output(scripted, p, q, cands + (choose(cands),), wor, point)
        return total

    unseen = lambda cands: min(set(range(v)) - set(cands))  # noqa: E731
    for choose in (unseen, lambda cands: cands[0]):
        assert torch.allclose(emitted(choose, True), p, atol=TOL, rtol=0)
    if k == 1 and seed == 0:  # where the residual after y is not one-hot (it is for some
        # p, q at V = 5, and then either test accepts x alike)
        assert (emitted(unseen, False) - p).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Greedy tree walk on crafted logits

GREEDY = Sampling()


def crafted_p(argmaxes: list[int | tuple[int, ...]], v: int = 6) -> torch.Tensor:
    """[n, v] distributions whose arg-max at row i is argmaxes[i] (a tuple: an exact tie)."""
    logits = torch.zeros(len(argmaxes), v)
    for i, best in enumerate(argmaxes):
        logits[i, list(best) if isinstance(best, tuple) else best] = 10.0
    return torch.softmax(logits, dim=-1)


def greedy_walk(tree: Tree, depth: int, tokens: list[int], argmaxes: list, eos_id: int | None,
                monkeypatch: pytest.MonkeyPatch) -> Verdict:
    def no_uniform(*args: object) -> torch.Tensor:
        raise AssertionError("greedy verification draws no uniform")

    monkeypatch.setattr(verify, "uniforms", no_uniform)
    n = tree.size(depth)
    q = torch.full((tree.size(depth - 1), 6), 1 / 6)  # unused when greedy
    return verify_tree(tree, depth, torch.tensor(tokens), crafted_p(argmaxes)[:n], q, GREEDY,
                       True, eos_id, None)


# Tree(1, (2, 2)): root 0; level 1: 1, 2; level 2: 3, 4 (under 1), 5, 6 (under 2).
TOKENS = [5, 4, 2, 1, 3, 0, 2]


def test_greedy_walk_follows_the_argmax_child(monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = greedy_walk(Tree(1, (2, 2)), 2, TOKENS, [2, 1, 0, 0, 0, 3, 3], None, monkeypatch)
    assert verdict.path == [0, 2, 5]
    assert int(torch.argmax(verdict.next_dist)) == 3  # the bonus token is the leaf's arg-max
    assert verdict.labels.tolist() == [-1, 0, 1, -1, -1, 1, 0]


def test_greedy_walk_emits_the_argmax_when_no_child_matches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = greedy_walk(Tree(1, (2, 2)), 2, TOKENS, [3, 1, 0, 0, 0, 0, 0], None, monkeypatch)
    assert verdict.path == [0]
    assert int(torch.argmax(verdict.next_dist)) == 3
    assert verdict.labels.tolist() == [-1, 0, 0, -1, -1, -1, -1]
    verdict = greedy_walk(Tree(1, (2, 2)), 2, TOKENS, [2, 1, 4, 0, 0, 0, 0], None, monkeypatch)
    assert verdict.path == [0, 2] and int(torch.argmax(verdict.next_dist)) == 4
    assert verdict.labels.tolist() == [-1, 0, 1, -1, -1, 0, 0]


def test_greedy_walk_stops_at_an_accepted_eos(monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = greedy_walk(Tree(1, (2, 2)), 2, TOKENS, [2, 1, 0, 0, 0, 3, 3], 2, monkeypatch)
    assert verdict.path == [0, 2] and verdict.next_dist is None
    assert verdict.labels.tolist() == [-1, 0, 1, -1, -1, -1, -1]  # nothing below an EOS tested


def test_greedy_walk_breaks_ties_by_first_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """p ties tokens 2 and 4: torch.argmax picks 2, so the walk follows node 2 (token 2) even
    though node 1 (token 4) is an equally likely, earlier child."""
    verdict = greedy_walk(Tree(1, (2, 2)), 2, TOKENS, [(2, 4), 0, 5, 0, 0, 0, 0], None,
                          monkeypatch)
    assert verdict.path == [0, 2]
    assert int(torch.argmax(verdict.next_dist)) == 5


def test_greedy_walk_on_a_tree_cut_at_depth_one(monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = greedy_walk(Tree(1, (2, 2)), 1, TOKENS[:3], [2, 1, 4], None, monkeypatch)
    assert verdict.path == [0, 2] and int(torch.argmax(verdict.next_dist)) == 4
    assert verdict.labels.tolist() == [-1, 0, 1]


# ---------------------------------------------------------------------------------------------
# Depth-2 sampling walk: joint distribution of the first two emitted tokens


def bigram(v: int, seed: int, zeros: int = 0) -> torch.Tensor:
    """[v, v] float64: row a is the next-token distribution after token a."""
    return torch.stack([random_dist(v, seed * 100 + a, zeros=zeros) for a in range(v)])


def tree_candidates(tree: Tree, root: int, q: torch.Tensor,
                    wor: bool) -> Iterator[tuple[list[int], float]]:
    """Every depth-2 tree below `root` (tokens in level order) with its probability: each
    level-1 node's children are drawn from q[its token] before anything is verified."""
    k1, k2 = tree.branching
    for level1, prob1 in candidate_tuples(q[root], k1, wor):
        per_node = [candidate_tuples(q[x], k2, wor) for x in level1]
        for level2 in itertools.product(*per_node):
            prob2 = math.prod(prob for _, prob in level2)
            yield [root, *level1, *(x for kids, _ in level2 for x in kids)], prob1 * prob2


END = -1  # column of the joint for "the sequence ended" (an EOS was emitted first)


def continuation(p: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """[V, V+1]: the second token given the first under target-only decoding (END after EOS)."""
    v = p.shape[0]
    then = torch.cat([p, torch.zeros(v, 1, dtype=p.dtype)], dim=1)
    if eos_id is not None:
        then[eos_id] = 0.0
        then[eos_id, END] = 1.0
    return then


def first_two_tokens(verdict: Verdict, tokens: list[int], p: torch.Tensor,
                     eos_id: int | None) -> torch.Tensor:
    """[V, V+1] distribution of the first two tokens emitted after the root: the accepted path,
    then a draw from next_dist, then target-only decoding (P) once the round is over."""
    emitted = [tokens[node] for node in verdict.path[1:]]
    out = torch.zeros(p.shape[0], p.shape[0] + 1, dtype=p.dtype)
    if len(emitted) >= 2:
        out[emitted[0], emitted[1]] = 1.0
    elif len(emitted) == 1 and verdict.next_dist is None:  # an accepted EOS
        out[emitted[0], END] = 1.0
    elif len(emitted) == 1:
        out[emitted[0], :-1] = verdict.next_dist.double()
    else:
        out = verdict.next_dist.double()[:, None] * continuation(p, eos_id)
    return out


@pytest.mark.parametrize("idles", [False, True], ids=["stops", "idles"])
@pytest.mark.parametrize("eos_id", [None, 1], ids=["no-eos", "eos"])
@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
@pytest.mark.parametrize("branching", [(2, 2), (3, 1)])
def test_depth_two_walk_emits_the_target_bigram(scripted: ScriptedUniform,
                                                monkeypatch: pytest.MonkeyPatch,
                                                branching: tuple[int, int], wor: bool,
                                                eos_id: int | None, idles: bool) -> None:
    """`idles`: the walk goes on through the levels left once over, as on a GPU."""
    monkeypatch.setattr(verify, "reads_are_free", lambda device: not idles)
    v, root = 4, 0
    p, q = bigram(v, 1, zeros=1), bigram(v, 2, zeros=1)  # truncated, mostly on other tokens
    tree = Tree(1, branching)
    joint = torch.zeros(v, v + 1, dtype=torch.float64)
    for tokens, prob in tree_candidates(tree, root, q, wor):
        ids = torch.tensor(tokens)
        p_rows, q_rows = p[ids], q[ids[: tree.size(1)]]
        for leaf_prob, _, _, verdict in branches(scripted, lambda: scripted_walk(
                scripted, tree, 2, ids, p_rows, q_rows, wor, eos_id)):
            joint += prob * leaf_prob * first_two_tokens(verdict, tokens, p, eos_id)
    expected = p[root][:, None] * continuation(p, eos_id)
    assert torch.allclose(joint, expected, atol=TOL, rtol=0), (joint - expected).abs().max()


SUPPORT = [0, 1, 3]  # where the draft's q has mass, of 5 tokens


def on_support(v: int, seed: int) -> torch.Tensor:
    """[v, v] float64 bigram whose rows are 0 outside SUPPORT (a pruned draft head's)."""
    q = torch.zeros(v, v, dtype=torch.float64)
    q[:, SUPPORT] = bigram(len(SUPPORT), seed)[torch.arange(v) % len(SUPPORT)]
    return q


def support_joint(scripted: ScriptedUniform, tree: Tree, wor: bool) -> torch.Tensor:
    """The first two tokens' joint from the walk over SUPPORT and the rest's slot."""
    v, root = 5, 0
    p, q = bigram(v, 1), on_support(v, 2)
    support = Support.of(torch.tensor(SUPPORT), v)
    joint = torch.zeros(v, v + 1, dtype=torch.float64)
    for tokens, prob in tree_candidates(tree, root, q, wor):
        ids = torch.tensor(tokens)
        for leaf_prob, _, _, verdict in branches(scripted, lambda: scripted_walk(
                scripted, tree, 2, ids, p[ids], q[ids[: tree.size(1)]], wor, None, support)):
            joint += prob * leaf_prob * first_two_tokens(verdict, tokens, p, None)
    return joint


@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
@pytest.mark.parametrize("branching", [(2, 2), (3, 1)])
def test_a_walk_over_the_draft_s_support_emits_the_target_bigram(
        scripted: ScriptedUniform, branching: tuple[int, int], wor: bool) -> None:
    """q has no mass off SUPPORT (2 and 4 of 5 tokens carry p's): the walk tests over the
    support and one slot for the rest (`Support`), and emits p's bigram exactly."""
    p = bigram(5, 1)
    expected = p[0][:, None] * continuation(p, None)
    joint = support_joint(scripted, Tree(1, branching), wor)
    assert torch.allclose(joint, expected, atol=TOL, rtol=0), (joint - expected).abs().max()


def test_the_rest_s_share_spread_evenly_is_caught(scripted: ScriptedUniform,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the rest's slot shared out evenly instead of in proportion to p
    biases the output, and the enumeration sees it."""
    def evenly(self: Support, lumped: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        outside = torch.ones_like(p, dtype=torch.float64).index_fill_(0, self.ids, 0.0)
        return (outside * lumped[-1] / outside.sum()).index_copy_(0, self.ids, lumped[:-1])

    monkeypatch.setattr(Support, "spread", evenly)
    p = bigram(5, 1)
    joint = support_joint(scripted, Tree(1, (2, 2)), True)
    assert (joint - p[0][:, None] * continuation(p, None)).abs().max() > 1e-3


@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
def test_the_walk_over_the_support_makes_the_whole_vocabulary_s_tests(wor: bool) -> None:
    """On random uniforms, the walk over a 12-token support of 50 (a candidate off it among
    them: q 0 there, skipped) takes the path, thresholds and residual of the walk over V."""
    v, tree, g = 50, Tree(1, (3, 2)), torch.Generator().manual_seed(0)
    ids = torch.randperm(v, generator=g)[:12]
    support = Support.of(ids, v)
    for seed in range(40):
        p = torch.stack([random_dist(v, 1000 * seed + i, zeros=5) for i in range(10)])
        q = torch.zeros(4, v, dtype=torch.float64)
        q[:, ids] = torch.stack([random_dist(12, 500 + 1000 * seed + i) for i in range(4)])
        tokens = ids[torch.randint(0, 12, (10,), generator=g)]
        tokens[3] = next(t for t in range(v) if t not in ids.tolist())  # off the support
        u = torch.rand(10, dtype=torch.float64, generator=g) * 1.5
        whole, made = sampled_walk(tree, 2, tokens, p, q, wor, None, u)
        lumped, lumped_made = sampled_walk(tree, 2, tokens, p, q, wor, None, u, support=support)
        assert lumped.path == whole.path and torch.equal(made.isnan(), lumped_made.isnan())
        assert torch.allclose(lumped_made.nan_to_num(), made.nan_to_num(), atol=TOL, rtol=0)
        assert torch.allclose(lumped.next_dist, whole.next_dist.double(), atol=TOL, rtol=0)


def with_chain(tree: Tree, ids: torch.Tensor, q_rows: torch.Tensor, chain: list[int],
               point: bool) -> tuple[Tree, Proposal]:
    """The drafted tree (depth 2) with a lookup `chain` merged as the runtime merges it: its
    first tokens follow the drafted nodes they retrace, the rest goes below the last of them
    (`lookup.with_lookup_branch`, its nodes point masses unless `point` is False)."""
    tokens, node, m = ids.tolist(), 0, 0
    for x in chain:
        same = [c for c in range(len(tokens)) if int(tree.parent[c]) == node and tokens[c] == x]
        if not same:
            break
        node, m = same[0], m + 1
    proposal = Proposal(tokens=ids, depth=2, root_position=0, q=q_rows, features=(),
                        fed=torch.full((len(tokens),), -1), steps=2, drafted=len(tokens) - 1)
    if m == len(chain):
        return tree, proposal
    merged, proposal = with_lookup_branch(tree, proposal, chain[m:], node)
    return merged, proposal if point else dataclasses.replace(proposal, point=None)


@pytest.mark.parametrize("branching", [(2, 1), (1, 1)])
@pytest.mark.parametrize("chain", [[1, 2], [2, 3], [3, 1], [0, 0]])
def test_a_walk_with_a_lookup_chain_emits_the_target_bigram(scripted: ScriptedUniform,
                                                            chain: list[int],
                                                            branching: tuple[int, int]) -> None:
    """A sampled tree with a lookup chain merged into it (after its drawn siblings, point
    masses: `Proposal.point`) emits the target's bigram exactly, whichever drafted nodes the
    chain retraces; tested as if drawn from their parents' q rows, its nodes bias the output
    (where that q is not spent on the drawn siblings)."""
    v, root, wor = 4, 0, True
    p, q = bigram(v, 1), bigram(v, 2)
    tree = Tree(1, branching)

    def joint(point: bool) -> torch.Tensor:
        out = torch.zeros(v, v + 1, dtype=torch.float64)
        for tokens, prob in tree_candidates(tree, root, q, wor):
            ids = torch.tensor(tokens)
            merged, proposal = with_chain(tree, ids, q[ids[: tree.size(1)]], chain, point)
            ids = proposal.tokens
            rows = proposal.q if point else q[ids[: merged.size(merged.max_depth - 1)]]
            for leaf_prob, _, _, verdict in branches(scripted, lambda: scripted_point_walk(
                    scripted, merged, ids, p[ids], rows, proposal.point)):
                out += prob * leaf_prob * first_two_tokens(verdict, ids.tolist(), p, None)
        return out

    expected = p[root][:, None] * continuation(p, None)
    assert torch.allclose(joint(True), expected, atol=TOL, rtol=0)
    if branching == (1, 1):
        assert (joint(False) - expected).abs().max() > 1e-3


def scripted_point_walk(u: ScriptedUniform, tree: Tree, ids: torch.Tensor, p: torch.Tensor,
                        q: torch.Tensor, point: torch.Tensor | None) -> Verdict:
    verdict, made = sampled_walk(tree, tree.max_depth, ids, p, q, True, None,
                                 u.draw(ids.shape[0]), point)
    u.report(made)
    return verdict


def test_sampling_walk_stops_at_an_accepted_eos(scripted: ScriptedUniform) -> None:
    tree = Tree(1, (2, 2))
    p, q = bigram(4, 3), bigram(4, 4)
    ids = torch.tensor([0, 3, 1, 2, 2, 0, 1])
    scripted.start([(1, False), (2, True)])  # reject node 1 (token 3), accept 2 (token 1 = EOS)
    verdict = scripted_walk(scripted, tree, 2, ids, p[ids], q[ids[:3]], True, 1)
    assert verdict.path == [0, 2] and verdict.next_dist is None
    assert scripted.tests()[0] == [1, 2]  # nothing below the EOS was tested
    assert verdict.labels.tolist() == [-1, 0, 1, -1, -1, -1, -1]


# ---------------------------------------------------------------------------------------------
# Dynamic trees (`tree`): which nodes are fed, hence the tree's shape, depends on the candidates


class BigramDraft:
    """A drafter whose logits after token a are log q[a] (nothing cached)."""

    target_layers: tuple[int, ...] = ()
    vocab_ids = None

    def __init__(self, q: torch.Tensor) -> None:  # [V, V]
        self.logits = q.log()

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        return self.logits[ids]


class ScriptedChildren:
    """Replaces `drafter.draft_children`: each fed node's candidates are the tuple a script picks
    among the `candidate_tuples` of its q (the first once the script is exhausted); records how
    many tuples each pick chose from and the picks' joint probability."""

    def __init__(self, wor: bool) -> None:
        self.wor = wor
        self.start([])

    def start(self, script: list[int]) -> None:
        self.script, self.options, self.prob = script, [], 1.0

    def __call__(self, q: torch.Tensor, k: int, sampling: Sampling, without_replacement: bool,
                 generator: torch.Generator | None) -> torch.Tensor:  # [m, V] -> [m, k]
        assert without_replacement == self.wor
        picks = []
        for row in q.double():
            tuples = candidate_tuples(row / row.sum(), k, self.wor)
            i = len(self.options)
            cands, prob = tuples[self.script[i] if i < len(self.script) else 0]
            self.options.append(len(tuples))
            self.prob *= prob
            picks.append(cands)
        return torch.tensor(picks)


def drafted_trees(children: ScriptedChildren, run: Callable[[], R]) -> list[tuple[float, R]]:
    """`run` once per pick of every fed node's candidates, with the picks' probability."""
    leaves, stack = [], [[]]
    while stack:
        script = stack.pop()
        children.start(script)
        result = run()
        picks = script + [0] * (len(children.options) - len(script))
        leaves.append((children.prob, result))
        for j in range(len(script), len(picks)):
            stack.extend(picks[:j] + [alt] for alt in range(1, children.options[j]))
    return leaves


DYNAMIC_TOL = 1e-7  # the draft's q passes through float32 (`warp`), as in the decode loop
# Feed the candidates whose path confidence exceeds 0.3 (the best one only); prune (greedy only)
# those whose survival is below ~0.25.
DYNAMIC_RULE = dict(expand=0.3, rho=0.5, max_width=1,
                    verify_cost=tuple(CostCurve({1: 1.0, 2: 1.5}).prices(16)))
# The sampling rule: a level's most valuable slots s_i * r[d][j], at most three, as many as pay
# for their verification (rho 0.1), none unless they gain more than 0.4; a level-1 node's own
# token decides how many children it gets, never whether it is verified.
SAMPLING_RULE = dict(DYNAMIC_RULE, expand=0.4, rho=0.1, max_width=3,
                     rank_accept=((0.9, 0.5), (0.8, 0.4)))


def dynamic_joint(scripted: ScriptedUniform, children: ScriptedChildren,
                  branching: tuple[int, int], eos_id: int | None, rule: dict = DYNAMIC_RULE
                  ) -> tuple[torch.Tensor, torch.Tensor, set[tuple[int, ...]]]:
    """(emitted joint [V, V+1] of the first two tokens after root 0, target-only decoding's,
    every verify tree's parents) over every drafted tree and accept/reject branch."""
    v, root = 4, 0
    p, q = bigram(v, 1, zeros=1), bigram(v, 2, zeros=1)
    policy = ConfidenceTree(TreeRule(branching, **rule))
    sampling = Sampling(temperature=1.0)
    context = RoundContext(0, 0, 0.0, 0.0, root_statistics(p[root]))
    joint, shapes = torch.zeros(v, v + 1, dtype=torch.float64), set()
    for prob, (tree, proposal, _) in drafted_trees(children, lambda: propose_tree(
            BigramDraft(q), policy, torch.tensor([root]), p[root].float(), 0, 2, context,
            sampling, children.wor, None)):
        ids = proposal.tokens
        shapes.add(tuple(tree.parent.tolist()))
        for leaf_prob, _, _, verdict in branches(scripted, lambda: scripted_walk(
                scripted, tree, proposal.depth, ids, p[ids], proposal.q, children.wor, eos_id)):
            joint += prob * leaf_prob * first_two_tokens(verdict, ids.tolist(), p, eos_id)
    return joint, p[root][:, None] * continuation(p, eos_id), shapes


@pytest.mark.parametrize("eos_id", [None, 1], ids=["no-eos", "eos"])
@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
@pytest.mark.parametrize("branching", [(2, 2), (3, 1)])
def test_dynamic_tree_emits_the_target_bigram(scripted: ScriptedUniform,
                                              monkeypatch: pytest.MonkeyPatch,
                                              branching: tuple[int, int], wor: bool,
                                              eos_id: int | None) -> None:
    children = ScriptedChildren(wor)
    monkeypatch.setattr(drafter, "draft_children", children)
    joint, expected, shapes = dynamic_joint(scripted, children, branching, eos_id)
    assert len(shapes) > 2  # the shape followed the candidates
    assert torch.allclose(joint, expected, atol=DYNAMIC_TOL, rtol=0), \
        (joint - expected).abs().max()


@pytest.mark.parametrize("rule", [DYNAMIC_RULE, SAMPLING_RULE], ids=["feed", "counts"])
def test_pruning_a_sampled_dynamic_tree_is_biased(scripted: ScriptedUniform,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  rule: dict) -> None:
    """Negative control (tree_rule.py): verifying only the candidates whose own survival is
    worth it changes the output distribution when sampling; hence `exact_under`."""
    children = ScriptedChildren(True)
    monkeypatch.setattr(drafter, "draft_children", children)
    monkeypatch.setattr(TreeRule, "exact_under", lambda rule, greedy: rule)
    joint, expected, _ = dynamic_joint(scripted, children, (2, 2), None, rule)
    assert abs(float(joint.sum()) - 1.0) < DYNAMIC_TOL
    assert (joint - expected).abs().max() > 1e-3


@pytest.mark.parametrize("eos_id", [None, 1], ids=["no-eos", "eos"])
@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
def test_sampling_tree_rule_emits_the_target_bigram(scripted: ScriptedUniform,
                                                    monkeypatch: pytest.MonkeyPatch, wor: bool,
                                                    eos_id: int | None) -> None:
    """The sampling rule (`tree_rule.children` with r) is exact: the count of candidates tested
    at a node never depends on their draws."""
    children = ScriptedChildren(wor)
    monkeypatch.setattr(drafter, "draft_children", children)
    joint, expected, shapes = dynamic_joint(scripted, children, (2, 2), eos_id, SAMPLING_RULE)
    assert len(shapes) > 2  # the counts followed the candidates
    assert torch.allclose(joint, expected, atol=DYNAMIC_TOL, rtol=0), \
        (joint - expected).abs().max()


@pytest.mark.parametrize("wor", [False, True], ids=["with-replacement", "without-replacement"])
def test_acceptance_is_each_test_s_exact_probability(wor: bool) -> None:
    """`acceptance` (the logged `accept_prob`) is min(1, t) of every test the walk makes, for
    every drafted node (repeats included), and the arg-max match under greedy decoding."""
    tree, v = Tree(1, (3, 2)), 4
    p, q = bigram(v, 3), bigram(v, 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, v, (tree.size(2),), generator=g)
        sampled = verify.acceptance(tree, 2, ids, p[ids], q[ids], Sampling(1.0), wor)
        _, made = sampled_walk(tree, 2, ids, p[ids], q[ids], wor, None,
                               torch.rand(ids.shape[0], dtype=torch.float64, generator=g))
        tested = ~made.isnan()
        assert sampled[0].isnan() and bool((sampled[1:] >= 0).all() & (sampled[1:] <= 1).all())
        assert torch.allclose(sampled[tested], made[tested].clamp_max(1.0),
                              atol=TOL, rtol=0)
        greedy = verify.acceptance(tree, 2, ids, p[ids], q[ids], Sampling(), wor)
        parent = tree.parent[1:]
        assert torch.equal(greedy[1:], (ids[1:] == p[ids].argmax(dim=1)[parent]).double())
