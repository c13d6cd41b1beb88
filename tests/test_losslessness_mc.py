"""Monte Carlo losslessness of the decode loop with bigram table models (VERIFICATION.md §5.2-4).

Target and draft are random bigram tables (`TableLM`: logits = table[token], so they do not
depend on the batch shape).  Under target-only decoding a bigram target makes the output a
Markov chain: every token is distributed as warp(table[previous token]).  Each run decodes short
sequences after a BOS prompt that neither table ever generates and counts the transitions
(previous token -> token): row BOS holds the first tokens; the other rows hold every later
token, whichever step produced it (an accepted draft, a correction from the residual, a bonus,
a root drawn from last round's residual).  A chi-square test per row (cells with expected count
< 5 pooled), the total variation against the exact warped table and "no excluded token is ever
emitted" must hold.  The joint of the first two tokens of every sequence is tested the same way.

`generate` costs ~0.2-0.5 ms of Python per decoded token here, so the budget is met by (1)
counting every transition of 10-token sequences rather than one sample per call and (2) two
spawned worker processes.  (The default `FixedDepth` policy reads no features, so the static
methods compute none; the `tree` method's survival is the draft's path confidence.)
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specstop.decoder.costs import CostCurve
from specstop.decoder.drafter import ModelDrafter, draft_children, draft_level
import specstop.decoder.verify as verify
from specstop.decoder.loop import DecodeConfig, generate
from specstop.decoder.methods import round_method
from specstop.decoder.policy import ConfidenceTree, TreePolicy
from specstop.decoder.sampling import Sampling, warp
from specstop.decoder.tree_rule import TreeRule

V = 5  # generated tokens 0..V-1; V is BOS
BOS = V
EOS = V - 1
SEQ_LEN = 10  # max_new_tokens of every sequence
WORKERS = 2


# ---------------------------------------------------------------------------------------------
# Table models


class TableLM:
    """Stand-in for `KVModel`: the logits after a token are table[token]; the cache is a length."""

    def __init__(self, table: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> None:
        self.table = table  # [V+1, V+1] float32 logits
        self.vocab_ids = vocab_ids  # a pruned draft's tokens (the rest of its logits -inf)
        self.vocab_size = table.shape[1]
        self.device = table.device
        self.dtype = table.dtype
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def extend(self, ids: torch.Tensor, positions: torch.Tensor,
               tail_allow: torch.Tensor | None) -> torch.Tensor:
        """ids [n], positions [n], tail_allow [n, tail] or None -> logits [n, V+1]."""
        assert ids.shape == positions.shape and ids.dim() == 1
        self.length += ids.shape[0]
        return self.table[ids]

    def extend_with_hidden(self, ids: torch.Tensor, positions: torch.Tensor,
                           tail_allow: torch.Tensor | None, features: None = None,
                           last_only: bool = False,
                           layers: tuple[int, ...] = (-1,)) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.extend(ids, positions, tail_allow)
        return (logits[-1:] if last_only else logits), logits[:, :0]

    def reserve(self, tokens: int) -> None:
        """Nothing to allocate."""

    def retain(self, committed: int, nodes: torch.Tensor) -> None:
        """Keep `committed` cached positions and the tree nodes `nodes` [k] after them."""
        assert committed + nodes.shape[0] <= self.length, (committed, nodes, self.length)
        self.length = committed + nodes.shape[0]


def bigram_tables(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, draft) [V+1, V+1] float32 logits; the draft is the target plus Gaussian noise, so
    they partly agree.  Nothing is ever generated after, or as, BOS; EOS is rarer than the rest.
    `scale` multiplies all logits (scale = T keeps the warped distributions spread at low T)."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V + 1, V + 1, generator=g)
    draft = target + torch.randn(V + 1, V + 1, generator=g)
    for table in (target, draft):
        table[:, EOS] -= 1.5
        table.mul_(scale)
        table[:, BOS] = float("-inf")
    return target, draft


def lossy_bias_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """§3's toy: the draft equals the target except after token 0, where it puts its mass on the
    target's least likely tokens.  DynaSD's longest-branch selection then avoids root 0."""
    target, _ = bigram_tables(7)
    draft = target.clone()
    draft[0, :V] = -target[0, :V]
    return target, draft


def expected_transitions(target: torch.Tensor, sampling: Sampling) -> np.ndarray:
    """[V+1, V+1] float64: row a = the warped target distribution after token a."""
    probs = warp(target, sampling).double()
    return (probs / probs.sum(dim=1, keepdim=True)).numpy()


# ---------------------------------------------------------------------------------------------
# Decoding runs (in worker processes)


@dataclass(frozen=True)
class Run:
    config: DecodeConfig
    seed: int  # tables
    min_transitions: int  # over all chunks
    lossy_tables: bool = False
    pruned_draft: bool = False  # the draft gives tokens outside a pruned vocabulary q = 0 (and
    # names the rest, its support, as a pruned head's `KVModel` does)
    policy: TreePolicy | None = None  # the `tree` method's

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lossy_tables:
            return lossy_bias_tables()
        target, draft = bigram_tables(self.seed, scale=self.config.sampling.temperature)
        if self.pruned_draft:  # tokens 1 and 3 are outside the draft's vocabulary
            draft[:, [1, 3]] = float("-inf")
        return target, draft


def decode_chunk(run: Run, chunk: int, n_chunks: int) -> np.ndarray:
    """Sequences [n, SEQ_LEN + 1] (BOS first; -1 after an EOS) of one chunk, seeded by chunk."""
    torch.set_num_threads(1)
    target, draft = run.tables()
    lm = TableLM(target)
    support = torch.isfinite(draft).all(dim=0).nonzero()[:, 0] if run.pruned_draft else None
    drafter = ModelDrafter(TableLM(draft, support)) \
        if round_method(run.config.method).drafts else None
    generator = torch.Generator().manual_seed(1000 * run.seed + chunk)
    prompt = torch.tensor([BOS])
    rows, transitions = [], 0
    while transitions < run.min_transitions / n_chunks:
        tokens = generate(lm, drafter, prompt, run.config, run.policy, eos_id=EOS,
                          generator=generator).tokens
        assert 1 <= len(tokens) <= SEQ_LEN
        assert len(tokens) == SEQ_LEN or tokens[-1] == EOS, tokens
        assert EOS not in tokens[:-1], tokens
        rows.append([BOS] + tokens + [-1] * (SEQ_LEN - len(tokens)))
        transitions += len(tokens)
    return np.array(rows, dtype=np.int64)


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    """Two spawned workers (fork is unsafe once torch's thread pools exist)."""
    context = multiprocessing.get_context("spawn")
    workers = max(1, min(WORKERS, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=context) as executor:
        yield executor


def submit(pool: ProcessPoolExecutor, run: Run) -> list[Future]:
    return [pool.submit(decode_chunk, run, chunk, WORKERS) for chunk in range(WORKERS)]


def sequences(futures: list[Future]) -> np.ndarray:
    return np.concatenate([future.result() for future in futures])


# ---------------------------------------------------------------------------------------------
# Statistics


def pooled_chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of one multinomial; cells with expected count
    below 5 are pooled (with the smallest other cell if the pool is still below 5)."""
    small = expected < 5
    obs, exp = list(observed[~small]), list(expected[~small])
    if small.any():
        pooled_obs, pooled_exp = observed[small].sum(), expected[small].sum()
        if pooled_exp < 5 and exp:
            i = int(np.argmin(exp))
            pooled_obs, pooled_exp = pooled_obs + obs.pop(i), pooled_exp + exp.pop(i)
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    obs_a, exp_a = np.array(obs, dtype=float), np.array(exp, dtype=float)
    return float(((obs_a - exp_a) ** 2 / exp_a).sum()), len(exp) - 1


@dataclass(frozen=True)
class Fit:
    p_value: float
    tv: float
    n: int
    impossible: int  # observations in cells of probability 0


def fit_rows(counts: np.ndarray, probs: np.ndarray) -> Fit:
    """Goodness of fit of counts [S, C] to row distributions probs [S, C], each row a multinomial
    with its own total (transitions conditional on the previous token)."""
    stat, df, impossible = 0.0, 0, 0
    for observed, p in zip(counts, probs):
        total = observed.sum()
        if total == 0:
            continue
        impossible += int(observed[p == 0].sum())
        s, d = pooled_chi_square(observed[p > 0], total * p[p > 0])
        stat, df = stat + s, df + d
    n = int(counts.sum())
    expected = counts.sum(axis=1, keepdims=True) * probs
    tv = float(np.abs(counts - expected).sum() / (2 * n))
    return Fit(float(chi2.sf(stat, df)) if df > 0 else 1.0, tv, n, impossible)


def transition_counts(seqs: np.ndarray) -> np.ndarray:
    """[V+1, V+1] counts of (previous, next) over every sequence."""
    prev, nxt = seqs[:, :-1].ravel(), seqs[:, 1:].ravel()
    ok = nxt >= 0
    return np.bincount(prev[ok] * (V + 1) + nxt[ok], minlength=(V + 1) ** 2).reshape(V + 1, V + 1)


def first_two(seqs: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Observed counts and probabilities [V * (V+1)] of the first two tokens (x1, x2); x2 is an
    extra 'ended' cell when x1 is EOS."""
    x1, x2 = seqs[:, 1], np.where(seqs[:, 2] >= 0, seqs[:, 2], V)
    counts = np.bincount(x1 * (V + 1) + x2, minlength=V * (V + 1))
    then = probs[:V, :V + 1].copy()  # column V (BOS) has probability 0: reuse it for 'ended'
    then[EOS] = 0.0
    then[EOS, V] = 1.0
    return counts, (probs[BOS, :V, None] * then).ravel()


def assert_lossless(seqs: np.ndarray, probs: np.ndarray, tv_max: float, first_tv_max: float,
                    min_transitions: int) -> None:
    rows = fit_rows(transition_counts(seqs), probs)
    counts, joint = first_two(seqs, probs)
    first = fit_rows(counts[None], joint[None])
    assert rows.n >= min_transitions
    assert rows.impossible == 0 and first.impossible == 0, "emitted a token of probability 0"
    assert rows.p_value > 1e-3 and rows.tv < tv_max, rows
    assert first.p_value > 1e-3 and first.tv < first_tv_max, first


# ---------------------------------------------------------------------------------------------
# The sweep over T in {0.3, 1.0} x top-p in {1.0, 0.9}.  Every method shares the same warp
# calls, so the sweep covers rather than crosses: each method with both warps on, each warp on
# its own for two methods, and with-replacement MCSD at the default.

BASE = DecodeConfig(method="sd", max_new_tokens=SEQ_LEN, max_depth=2, mcsd_branching=(2, 2),
                    ti_width=3)
METHODS = {
    "sd": BASE,
    "mcsd-wor": replace(BASE, method="mcsd"),
    "mcsd-wr": replace(BASE, method="mcsd", without_replacement=False),
    "ti-mcsd": replace(BASE, method="ti-mcsd"),
    "tree": replace(BASE, method="tree", max_depth=3),
    "tree-counts": replace(BASE, method="tree", max_depth=3),
    "lookup": replace(BASE, method="lookup"),  # its draft table goes unused
    "tree-lookup": replace(BASE, method="tree", max_depth=3, lookup_branch=True),
    "tree-lookup-counts": replace(BASE, method="tree", max_depth=3, lookup_branch=True),
    "mcsd-lookup": replace(BASE, method="mcsd", lookup_branch=True, lookup_tokens=3),
}
# Expands some nodes but not all (the draft's path confidence above 0.3, two per level at most);
# its pruning (verify a node while its survival beats 0.5 x 0.5 target steps) is for greedy
# decoding only, so these sampled runs must verify every drafted node.
TREE_RULE = TreeRule((2, 2, 1), expand=0.3, rho=0.5, max_width=2,
                     verify_cost=tuple(CostCurve({1: 1.0, 2: 1.5}).prices(16)))
# The sampling rule: child j of node i iff its path confidence times r[d][j] exceeds 0.2, at most
# three a level (0 to 2 children per node, decided before they are drawn).
SAMPLING_RULE = replace(TREE_RULE, expand=0.2, max_width=3,
                        rank_accept=((0.9, 0.5), (0.8, 0.4), (0.7,)))
# With a lookup branch (`tree-lookup*`): the chain the text's bigrams look up joins each tree
# (following the drafted nodes it retraces, then below them; a point mass tested after its
# drawn siblings), its prefix that pays kept (a certain chain: all that the room allows).  The
# exact enumeration (test_verify_exact.py) holds its negative control: on these tables, after
# two or three drawn siblings, a chain node tested as if drawn is biased too little to see.
# `mcsd-lookup` is collect's sampled round: the static tree with the whole chain beside it.
POLICIES = {"tree": ConfidenceTree(TREE_RULE), "tree-counts": ConfidenceTree(SAMPLING_RULE),
            "tree-lookup": ConfidenceTree(TREE_RULE),
            "tree-lookup-counts": ConfidenceTree(SAMPLING_RULE)}
MAIN = [(method, 1.0, 1.0) for method in ("sd", "mcsd-wor", "ti-mcsd", "lookup")]
SWEEP = ([("mcsd-wr", 1.0, 1.0), ("tree", 1.0, 1.0), ("tree-counts", 1.0, 1.0),
          ("tree-lookup", 1.0, 1.0), ("tree-lookup-counts", 1.0, 1.0), ("mcsd-lookup", 1.0, 1.0)]
         + [(method, 0.3, 0.9) for method in METHODS]
         + [("sd", 0.3, 1.0), ("ti-mcsd", 0.3, 1.0), ("mcsd-wor", 1.0, 0.9), ("mcsd-wr", 1.0, 0.9)])


def run_for(method: str, temperature: float, top_p: float, seed: int, n: int) -> Run:
    return Run(replace(METHODS[method], sampling=Sampling(temperature, top_p)), seed, n,
               policy=POLICIES.get(method))


def decode_and_fit(pool: ProcessPoolExecutor, run: Run, tv_max: float,
                   first_tv_max: float) -> None:
    seqs = sequences(submit(pool, run))
    probs = expected_transitions(run.tables()[0], run.config.sampling)
    assert_lossless(seqs, probs, tv_max, first_tv_max, run.min_transitions)


@pytest.mark.parametrize("method,temperature,top_p", MAIN)
def test_lossless_at_1e5_transitions(pool: ProcessPoolExecutor, method: str,
                                     temperature: float, top_p: float) -> None:
    decode_and_fit(pool, run_for(method, temperature, top_p, seed=1, n=100_000),
                   tv_max=0.01, first_tv_max=0.03)


@pytest.mark.parametrize("method,temperature,top_p", SWEEP)
def test_lossless_at_1e4_transitions(pool: ProcessPoolExecutor, method: str,
                                     temperature: float, top_p: float) -> None:
    decode_and_fit(pool, run_for(method, temperature, top_p, seed=2, n=10_000),
                   tv_max=0.03, first_tv_max=0.1)


@pytest.mark.parametrize("method", ["sd", "mcsd-wor", "tree-counts"])
def test_pruned_vocabulary_draft_is_lossless(pool: ProcessPoolExecutor, method: str) -> None:
    """A draft with a pruned output vocabulary (q = 0 outside it, its candidates drawn over
    its support: `drafter.draft_level`): the target's tokens outside the draft's vocabulary
    still come out at their exact rate, through the residual."""
    run = replace(run_for(method, 1.0, 1.0, seed=3, n=20_000), pruned_draft=True)
    decode_and_fit(pool, run, tv_max=0.02, first_tv_max=0.06)


def test_lossy_ti_mcsd_fails_the_same_test(pool: ProcessPoolExecutor) -> None:
    """Negative control: DynaSD's longest-branch root selection biases the roots; exact
    ti-mcsd passes on the same tables."""
    config = replace(METHODS["ti-mcsd"], lossy=True, ti_width=2, sampling=Sampling(1.0))
    lossy = Run(config, 0, 5_000, lossy_tables=True)
    probs = expected_transitions(lossy.tables()[0], config.sampling)
    rows = fit_rows(transition_counts(sequences(submit(pool, lossy))), probs)
    assert rows.p_value < 1e-6 and rows.tv > 0.03, rows
    exact = Run(replace(config, lossy=False), 0, 10_000, lossy_tables=True)
    assert_lossless(sequences(submit(pool, exact)), probs, 0.03, 0.1, exact.min_transitions)


class PruningRule(TreeRule):
    """The lossy rule: drops drafted nodes by their own survival (`verify_set`) under sampling
    too, which `TreeRule.exact_under` forbids."""

    def exact_under(self, greedy: bool) -> TreeRule:
        return self


def test_pruning_by_own_score_fails_the_same_test(pool: ProcessPoolExecutor) -> None:
    """Negative control: the sampling rule's tree with each node verified only while its own
    path confidence beats 0.5 (rho 1, each node 0.5 target steps) biases the output."""
    lossy = PruningRule(**{**SAMPLING_RULE.__dict__, "rho": 1.0})
    run = replace(run_for("tree-counts", 1.0, 1.0, seed=2, n=20_000),
                  policy=ConfidenceTree(lossy))
    probs = expected_transitions(run.tables()[0], run.config.sampling)
    rows = fit_rows(transition_counts(sequences(submit(pool, run))), probs)
    assert rows.p_value < 1e-6, rows


def test_lookup_without_the_residual_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a rejected lookup token drawn again from p (no residual: the correction
    may repeat the rejected token) is emitted too often; in this process, with `residual`
    patched, for 10k transitions."""
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    run = run_for("lookup", 1.0, 1.0, seed=2, n=10_000)
    probs = expected_transitions(run.tables()[0], run.config.sampling)
    threads = torch.get_num_threads()
    try:
        seqs = decode_chunk(run, 0, 1)
    finally:
        torch.set_num_threads(threads)
    rows = fit_rows(transition_counts(seqs), probs)
    assert rows.p_value < 1e-6, rows


# ---------------------------------------------------------------------------------------------
# Greedy: exact methods equal target greedy decoding; lossy ti-mcsd does not


def greedy_chain(target: torch.Tensor, first: int, n: int) -> list[int]:
    """Target-only greedy decoding of a bigram table, by hand."""
    out, token = [], first
    for _ in range(n):
        token = int(torch.argmax(target[token]))
        out.append(token)
    return out


@pytest.mark.parametrize("method", list(METHODS) + ["ar"])
def test_greedy_equals_target_argmax_chain(method: str) -> None:
    config = replace(METHODS.get(method, replace(BASE, method="ar")), max_new_tokens=30,
                     max_depth=3, sampling=Sampling())
    for seed in range(5):
        target, draft = bigram_tables(seed)
        drafter = ModelDrafter(TableLM(draft)) if round_method(config.method).drafts else None
        tokens = generate(TableLM(target), drafter, torch.tensor([BOS]), config,
                          POLICIES.get(method)).tokens
        assert tokens == greedy_chain(target, BOS, 30), (method, seed)


def test_lossy_ti_mcsd_greedy_commits_a_non_argmax_root() -> None:
    """After BOS the target's top-2 are tokens 0 and 1; the draft disagrees with the target only
    after 0, so DynaSD's branch 1 accepts more and its root (rank 2) is committed."""
    target = torch.full((V + 1, V + 1), -5.0)
    target[BOS, 0], target[BOS, 1] = 2.0, 1.0
    target[:BOS, 2] = 3.0  # after any token the target's arg-max is 2
    target[:, BOS] = float("-inf")
    draft = target.clone()
    draft[0, 2], draft[0, 3] = -5.0, 3.0  # ... except the draft thinks 3 follows 0
    greedy = Sampling()
    ar = generate(TableLM(target), None, torch.tensor([BOS]),
                  DecodeConfig(method="ar", max_new_tokens=4, sampling=greedy)).tokens
    lossy = generate(TableLM(target), ModelDrafter(TableLM(draft)), torch.tensor([BOS]),
                     DecodeConfig(method="ti-mcsd", lossy=True, ti_width=2, max_depth=2,
                                  max_new_tokens=4, sampling=greedy)).tokens
    exact = generate(TableLM(target), ModelDrafter(TableLM(draft)), torch.tensor([BOS]),
                     DecodeConfig(method="ti-mcsd", ti_width=2, max_depth=2, max_new_tokens=4,
                                  sampling=greedy)).tokens
    assert ar == exact == [0, 2, 2, 2]
    assert lossy[0] == 1 and lossy != ar


# ---------------------------------------------------------------------------------------------
# The drafter's candidate sampling (what the exact enumeration assumes)


@pytest.mark.parametrize("without_replacement", [False, True])
def test_draft_children_draw_the_documented_tuple_distribution(without_replacement: bool) -> None:
    """k = 2 candidates: i.i.d. from q, or sequentially from the renormalised rest; tokens with
    q = 0 only appear as padding once q's support is used up."""
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 200_000
    kids = draft_children(q.expand(n, 4), 2, Sampling(1.0), without_replacement,
                          torch.Generator().manual_seed(3))
    counts = np.bincount((kids[:, 0] * 4 + kids[:, 1]).numpy(), minlength=16).astype(float)
    probs = np.outer(q.double().numpy(), q.double().numpy())
    if without_replacement:
        probs = probs / (1 - q.double().numpy())[:, None]
        np.fill_diagonal(probs, 0.0)
    fit = fit_rows(counts[None], probs.ravel()[None])
    assert fit.impossible == 0 and fit.p_value > 1e-3 and fit.tv < 0.005, fit
    tiny = torch.tensor([[0.0, 0.7, 0.0, 0.3]])  # support 2 < k = 3
    padded = draft_children(tiny.expand(1000, 4), 3, Sampling(1.0), True,
                            torch.Generator().manual_seed(4))
    assert torch.all(tiny[0, padded[:, 2]] == 0) and torch.all(tiny[0, padded[:, :2]] > 0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_level_drawn_over_the_drafts_support_is_drawn_from_q(temperature: float) -> None:
    """`draft_level` warps and draws a pruned head's level over its support only: its q is the
    full vocabulary's warp, its candidates lie in the support (greedy: the full top-k), and the
    first candidate comes out at q's rates."""
    support = torch.tensor([0, 2, 3, 5])
    logits = torch.full((1, 7), float("-inf"))
    logits[0, support] = torch.tensor([0.2, 1.5, -0.4, 0.9])
    sampling = Sampling(temperature)
    n = 100_000 if temperature else 1
    level = draft_level(logits.expand(n, 7), support, 2, sampling, True,
                        torch.Generator().manual_seed(5))
    q = warp(logits, sampling)[0]
    assert torch.allclose(level.q, q.expand(n, 7), atol=1e-7, rtol=0)
    assert torch.equal(level.tokens, support[level.columns])
    assert torch.equal(level.support_q, level.q[:, support])
    if not temperature:
        assert level.tokens.tolist() == [q.topk(2).indices.tolist()]
        return
    counts = np.bincount(level.tokens[:, 0].numpy(), minlength=7).astype(float)
    fit = fit_rows(counts[None], q.double().numpy()[None])
    assert fit.impossible == 0 and fit.p_value > 1e-3 and fit.tv < 0.01, fit
