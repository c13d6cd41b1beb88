"""Stage `train`'s tree comparison: every tree policy in one replay of the val rounds.

Static shapes (chains, `ti-mcsd`-like, the grid), Sequoia's tree, the EAGLE-2-style dynamic
tree (the draft's own confidence as survival) and each family's dynamic tree, under one cost
model and the oracle (`replay.tree_replay`).  "Best static" is the fastest static entry.  Each
family's tree also gets its round gate, or `ar` where nothing drafting beats it
(`models.round_gate`): the winner is reported against `ar` (speedup 1).  With the logged
lookup chains, the lookup's decision model (`models.lookup_model`) is fitted on train's, and
each dynamic tree is replayed with the chain as one more source (its rule as tuned), with the
chain's survival learned and certain, beside `lookup` alone (walked along the val texts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from scipy.special import expit, logit
from tqdm import tqdm

from specstop.decoder.costs import CostModel
from specstop.decoder.lookup import LookupModel
from specstop.decoder.round_gate import RoundGate
from specstop.decoder.tree_rule import TreeRule

from specstop.collection.data import ROUND_KEYS
from specstop.evaluation import plots
from specstop.replay.lookup_chains import LookupChains, lookup_alone
from specstop.replay.tree_replay import (WIDTH_GRID, TreeCosts, TreeReplay, TreeResult, Tuned,
                                         best_static, sequoia, tune_dynamic, tune_sampling)

from . import evaluate, lookup_model, round_gate

LOOKUP_ROOM = 16  # chain tokens every tuned rule prices beyond its largest tree (the runtime
# adds no more than a rule prices)
STATIC = ("static_chain", "static_ti_mcsd", "static_tree", "sequoia")
CONFIDENCE_TREE = "confidence_tree"
TARGETS = {"10pct_over_best_static": ("vs_best_static", 1.10),  # the replay targets
           "5pct_over_confidence_tree": ("vs_confidence_tree", 1.05),
           "92pct_of_oracle": ("fraction_of_oracle", 0.92)}


class Ranking:
    """What both comparisons rank alike: the fastest static policy and the fastest family among
    `tuned`, and the winner against the best static policy and the confidence tree."""

    tuned: dict[str, Tuned]
    families: tuple[str, ...]

    @property
    def best_static(self) -> str:
        return fastest(self.tuned, [n for n in STATIC if n in self.tuned])

    @property
    def winner(self) -> str | None:
        """The fastest family's dynamic tree."""
        return fastest(self.tuned, self.families) if self.families else None

    def static_shape(self) -> dict:
        """The best shape of the static grid (`static_tree`): widths, depth and its speed."""
        static = self.tuned["static_tree"]
        return {**static.setting, "speedup": static.result.speedup}

    def static_fallback(self, family: str, speed: float) -> dict | None:
        """`static_shape` where it replayed faster than `family`'s policy (`speed`) and than
        `ar`, which the stop model then decodes instead (`decoder.methods.with_static_fallback`);
        None elsewhere."""
        shape = self.static_shape()
        return shape if shape["speedup"] > max(speed, 1.0) else None

    def winner_entry(self) -> dict:
        """The winner's speed, over the best static policy's and the confidence tree's."""
        speed = self.tuned[self.winner].result.speedup
        return {"family": self.winner, "simulated_speedup": speed,
                "vs_best_static": speed / self.tuned[self.best_static].result.speedup,
                "vs_confidence_tree": speed / self.tuned[CONFIDENCE_TREE].result.speedup}


@dataclass(frozen=True)
class TreeComparison(Ranking):
    tuned: dict[str, Tuned]  # every policy by name (families by their family name)
    rules: dict[str, TreeRule]  # the dynamic policies' tuned rules
    oracle: TreeResult
    families: tuple[str, ...]
    replay: TreeReplay  # the val rounds
    train_replay: TreeReplay  # the train rounds (Sequoia's acceptance table)
    replay_rows: pd.DataFrame  # their round keys, node, parent, depth and token, in order
    costs: CostModel
    gate: RoundGate | None = None  # fitted on the train rounds, not yet tuned
    gate_features: np.ndarray | None = None  # [R, len(GATE_FEATURES)] of the val rounds
    gates: dict[str, round_gate.GateChoice] = field(default_factory=dict)  # by family
    lookup_model: LookupModel | None = None  # fitted on the train chains (`with_lookup`)
    lookup: dict = field(default_factory=dict)  # metrics/train.json's `replay.lookup`

    def with_lookup(self, chains: pd.DataFrame, families: dict[str, tuple[np.ndarray, float]]
                    ) -> "TreeComparison":
        """This comparison with the lookup's model fitted on the train `chains` and every
        dynamic tree (`families`, the confidence tree) replayed with val's chains beside it,
        behind its round gate (a gated round proposes the chain alone, as the runtime's)."""
        model, fitted = lookup_model.fit(chains)
        on_val = chains[(chains["split"] == "val") & (chains["temperature"] == 0)]
        val = LookupChains.from_rows(on_val, self.replay_rows)
        gated, without = {}, {}
        for name in families:
            gate = self.gates[name].gate if name in self.gates else None
            gated[name] = None if gate is None else ~gate.drafting(self.gate_features)  # the
            # chain alone (as the runtime's gated rounds)
            without[name] = (self.tuned[name] if gate is None else self.gates[name]).result.speedup
        policies = chain_policies(self.replay, val, model, self.rules, families, self.costs,
                                  without, gated)
        metrics = {"model": None if model is None else model.as_dict(), **fitted,
                   "chains": int(len(np.unique(val.round_index))), "rounds": self.replay.rounds,
                   "first_token_drafted": float((val.match[val.position == 1] >= 0).mean())
                   if len(val) else None,
                   "alone": lookup_alone(on_val, _tree_costs(self.costs, self.replay,
                                                             0.0).verify),
                   "policies": policies}
        if self.winner is not None:
            metrics["winner"] = {"family": self.winner, **policies[self.winner]}
        return replace(self, lookup_model=model, lookup=metrics)

    def tune(self, name: str, p: np.ndarray, latency: float) -> tuple[Tuned, TreeRule]:
        """A dynamic tree for per-row probabilities p on these rounds, `latency` seconds
        charged per draft step, rho started at the best static speed."""
        start = self.tuned[self.best_static].result.speedup
        return tune_dynamic(name, self.replay, p, _tree_costs(self.costs, self.replay, latency),
                            start)

    def choose_gate(self, name: str, p: np.ndarray, latency: float) -> round_gate.GateChoice:
        """The round gate, none or `ar` for the tuned dynamic tree `name`."""
        costs = _tree_costs(self.costs, self.replay, latency)
        return round_gate.choose(self.replay, p, self.rules[name], costs, self.gate,
                                 self.gate_features)

    def metrics(self) -> dict:
        """metrics/train.json's `replay` section (CONTRACTS.md)."""
        static = self.tuned[self.best_static].result.speedup
        out = {"best_static": {"method": self.best_static, "simulated_speedup": static},
               "oracle": self.oracle.as_dict(),
               "policies": {n: {**t.result.as_dict(), **t.setting,
                                "vs_best_static": t.result.speedup / static,
                                "fraction_of_oracle": t.result.speedup / self.oracle.speedup}
                            for n, t in self.tuned.items()}}
        if self.winner is not None:
            speed = self.tuned[self.winner].result.speedup
            winner = {**self.winner_entry(), "fraction_of_oracle": speed / self.oracle.speedup,
                      **self.gates[self.winner].metrics()}
            out["winner"] = winner
            out["targets"] = {key: winner[name] >= bound
                              for key, (name, bound) in TARGETS.items()}
        if self.lookup:
            out["lookup"] = self.lookup
        return out


@dataclass(frozen=True)
class SamplingComparison(Ranking):
    """The tree policies on the sampled val rounds of one temperature, scored by exact expected
    tokens: the static shapes (every drafted node verified) and the sampling rule
    (`tree_rule.children`) with the draft's confidence and each family's p as survival."""

    temperature: float
    tuned: dict[str, Tuned]
    rules: dict[str, TreeRule]  # the sampling rules, by policy name
    families: tuple[str, ...]
    ceiling: Tuned  # the sampling rule with each node's exact acceptance as its p: a perfect
    # predictor's (not decodable: it reads the target's distributions), what no model beats
    lookup: dict = field(default_factory=dict)  # `replay.sampling.lookup`: each rule with the
    # logged lookup chains beside it

    def metrics(self) -> dict:
        """metrics/train.json's `replay.sampling`."""
        static = self.tuned[self.best_static].result.speedup
        out = {"temperature": self.temperature,
               "best_static": {"method": self.best_static, "simulated_speedup": static},
               "policies": {n: {**t.result.as_dict(), **t.setting,
                                "vs_best_static": t.result.speedup / static}
                            for n, t in self.tuned.items()},
               "ceiling": {**self.ceiling.result.as_dict(), **self.ceiling.setting,
                           "vs_best_static": self.ceiling.result.speedup / static}}
        if self.winner is not None:
            out["winner"] = {**self.winner_entry(),
                             "vs_ar": self.tuned[self.winner].result.speedup}
        if self.lookup:
            out["lookup"] = self.lookup
        return out


def fastest(tuned: dict[str, Tuned], names) -> str:
    """The name among `names` whose tuned policy replays fastest (the first on a tie)."""
    return max(names, key=lambda n: tuned[n].result.speedup)


def compare_sampling(train: pd.DataFrame, val: pd.DataFrame, costs: CostModel,
                     q_token: np.ndarray, families: dict[str, tuple[np.ndarray, float]],
                     temperature: float, chains: pd.DataFrame | None = None,
                     model: LookupModel | None = None) -> SamplingComparison:
    """Every tree policy on the sampled val rows (`compare`'s arguments, rows of one
    temperature); the sampling rule's rank table is fitted on the sampled train rows; the
    ceiling: the rule tuned with the rows' exact `accept_prob` as p.  With the logged lookup
    `chains` (those of these rounds: collect verified them beside the superset), every rule is
    also replayed with the chain beside it, its survivals from the lookup's `model` (fitted on
    the greedy train chains) and certain."""
    shape = branching(costs)
    logged = None if chains is None else LookupChains.from_rows(chains, val)
    replay = TreeReplay.from_rows(val, shape, logged)
    table = TreeReplay.from_rows(train, shape).rank_acceptance()
    base = _tree_costs(costs, replay, 0.0)
    tuned, rules = dict(best_static(replay, base)), {}
    start = max(t.result.speedup for t in tuned.values())
    for name, (p, latency) in {CONFIDENCE_TREE: (q_token, 0.0), **families}.items():
        tuned[name], rule = tune_sampling(name, replay, p, _tree_costs(costs, replay, latency),
                                          table, start)
        rules[name] = rule.exact_under(greedy=False)  # verifies every node it drafts
    ceiling, _ = tune_sampling("ceiling", replay, val["accept_prob"].to_numpy(np.float64), base,
                               table, start)
    lookup = {}
    if logged is not None and len(logged):
        every = {CONFIDENCE_TREE: (q_token, 0.0), **families}
        policies = chain_policies(replay, logged, model, rules, every, costs,
                                  {name: tuned[name].result.speedup for name in every}, {})
        lookup = {"chains": int(len(np.unique(logged.round_index))), "rounds": replay.rounds,
                  "policies": policies}
        if families:
            winner = fastest(tuned, tuple(families))
            lookup["winner"] = {"family": winner, **policies[winner]}
    return SamplingComparison(temperature, tuned, rules, tuple(families), ceiling, lookup)


def chain_policies(replay: TreeReplay, chains: LookupChains, model: LookupModel | None,
                   rules: dict[str, TreeRule], families: dict[str, tuple[np.ndarray, float]],
                   costs: CostModel, without: dict[str, float],
                   gated: dict[str, np.ndarray | None]) -> dict[str, dict]:
    """Each dynamic tree of `families` (its p and decision latency) replayed by its rule with
    the logged `chains` beside it, behind its round gate where `gated` names one, the chain's
    survivals from the lookup's `model` and certain, against its speed `without` them."""
    policies = {}
    for name, (p, latency) in families.items():
        tree_costs = _tree_costs(costs, replay, latency)
        learned, certain = (replay.dynamic(p, rules[name], tree_costs, gated.get(name), chains,
                                           chains.survival(m)).speedup for m in (model, None))
        policies[name] = {"simulated_speedup": learned, "with_vs_without": learned / without[name],
                          "certain_chain_speedup": certain, "learned_vs_certain": learned / certain}
    return policies


def branching(costs: CostModel) -> tuple[int, ...]:
    """Children per node by level of the logged tree (one root), from its sizes by depth."""
    widths = np.diff((0, *costs.tree_sizes))
    return tuple(int(b // a) for a, b in zip(widths, widths[1:]))


def compare(train: pd.DataFrame, val: pd.DataFrame, costs: CostModel, q_token: np.ndarray,
            families: dict[str, tuple[np.ndarray, float]],
            chains: pd.DataFrame | None = None) -> TreeComparison:
    """Every policy on the val rows; `families` maps a family to (p of every val row, its
    decision latency in seconds, charged per draft step); with the logged lookup `chains`
    (`collection.rows.read_lookup_rows`), also with the lookup branch (`with_lookup`)."""
    shape = branching(costs)
    comparison = _tuned(TreeReplay.from_rows(val, shape), TreeReplay.from_rows(train, shape),
                        val[[*ROUND_KEYS, "node", "parent", "depth", "token"]], costs, q_token,
                        families, round_gate.fit(train), round_gate.round_features(val))
    for name, (p, latency) in families.items():
        comparison.gates[name] = comparison.choose_gate(name, p, latency)
    if chains is not None and len(chains):
        return comparison.with_lookup(chains, {CONFIDENCE_TREE: (q_token, 0.0), **families})
    return comparison


def _tuned(replay: TreeReplay, train_replay: TreeReplay, rows: pd.DataFrame, costs: CostModel,
           q_token: np.ndarray, families: dict[str, tuple[np.ndarray, float]],
           gate: RoundGate | None = None, gate_features: np.ndarray | None = None
           ) -> TreeComparison:
    """The static policies, the oracle and every dynamic tree (the confidence tree's and
    `families`') tuned on `replay` for `costs`; no round gate chosen yet."""
    base = _tree_costs(costs, replay, 0.0)
    static = {**best_static(replay, base), "sequoia": sequoia(replay, train_replay, base)}
    comparison = TreeComparison(static, {}, replay.oracle(base), tuple(families), replay,
                                train_replay, rows, costs, gate, gate_features)
    for name, (p, latency) in {CONFIDENCE_TREE: (q_token, 0.0), **families}.items():
        comparison.tuned[name], comparison.rules[name] = comparison.tune(name, p, latency)
    return comparison


def regimes(trees: TreeComparison, q_token: np.ndarray, family: str, p: np.ndarray,
            latency: float, draft_costs: list[float], verify_slopes: list[float]) -> list[dict]:
    """`trees`' policies tuned again on its rounds for each cost curve of the grid
    (`CostModel.scaled`: draft steps times a `draft_costs` entry, passes above a one-token
    step times a `verify_slopes` entry), with `family`'s p (and `latency`) only: where on
    other machines' curves its tree would beat the best static shape and the confidence tree,
    with no retraining (`replay.regimes`)."""
    out = []
    for draft, slope in tqdm(list(product(draft_costs, verify_slopes)), desc="regimes",
                             unit="curve"):
        scaled = trees.costs.scaled(draft, slope)
        comparison = _tuned(trees.replay, trees.train_replay, trees.replay_rows, scaled, q_token,
                            {family: (p, latency)})
        static, speed = comparison.best_static, comparison.tuned[family].result.speedup
        out.append({"draft_cost": draft, "verify_slope": slope,
                    "c": scaled.draft.step / scaled.target.step,
                    "best_static": {"method": static, "simulated_speedup":
                                    comparison.tuned[static].result.speedup},
                    "confidence_tree": comparison.tuned[CONFIDENCE_TREE].result.speedup,
                    "oracle": comparison.oracle.speedup,
                    "winner": {"family": family, "simulated_speedup": speed,
                               **{k: v for k, v in comparison.winner_entry().items()
                                  if k.startswith("vs_")}}})
    return out


def reach(trees: TreeComparison, p: np.ndarray, latency: float,
          strengths: list[float]) -> list[dict]:
    """The winner's greedy tree as its predictor gets better: for each strength s, p's log-odds
    moved s toward every val row's outcome (+s where the row was accepted, -s elsewhere: a
    predictor of higher AUC, which reads the labels and so is not decodable), re-tuned as the
    winner's is (`latency` charged per draft step): the AUC over the tested rows, the speed,
    and that over the confidence tree's and the best static shape's (`replay.reach`).  What
    AUC a model would need on these rounds and costs for a given gain."""
    tested, accepted = trees.replay.tested > 0, trees.replay.accepted
    log_odds = logit(p.clip(1e-6, 1 - 1e-6))
    confidence = trees.tuned[CONFIDENCE_TREE].result.speedup
    static = trees.tuned[trees.best_static].result.speedup
    out = []
    for s in tqdm(strengths, desc="reach", unit="strength"):
        moved = expit(log_odds + s * np.where(accepted, 1.0, -1.0))
        speed = trees.tune(f"reach-{s:g}", moved, latency)[0].result.speedup
        out.append({"strength": s, "auc": evaluate.quality(accepted[tested],
                                                           moved[tested])["auc"],
                    "simulated_speedup": speed, "vs_confidence_tree": speed / confidence,
                    "vs_best_static": speed / static})
    return out


def write_reach(entries: list[dict], folder: Path) -> None:
    """The reach curve: the winner's tree over the confidence tree's and the best static
    shape's against its predictor's AUC (`dvc plots`)."""
    plots.write_csv(folder / "reach.csv", ["auc", "vs_confidence_tree", "vs_best_static"],
                    [(e["auc"], e["vs_confidence_tree"], e["vs_best_static"]) for e in entries])


def write_regimes(entries: list[dict], folder: Path) -> None:
    """The winner over the confidence tree and over the best static shape against c, one
    CSV per verify slope (`dvc plots`)."""
    for slope in sorted({e["verify_slope"] for e in entries}):
        rows = sorted((e["c"], e["winner"]["vs_confidence_tree"], e["winner"]["vs_best_static"])
                      for e in entries if e["verify_slope"] == slope)
        plots.write_csv(folder / "regimes" / f"verify_slope_{slope:g}.csv",
                        ["c", "winner_vs_confidence_tree", "winner_vs_best_static"], rows)


def _tree_costs(costs: CostModel, replay: TreeReplay, latency: float) -> TreeCosts:
    """The cost tables for every tree of the replay: passes up to the superset's size, draft
    steps up to its widest level or the widest width tried."""
    widest = max(max(WIDTH_GRID), *np.diff((0, *costs.tree_sizes)))
    return TreeCosts.from_model(costs, len(replay.tree.parent) + LOOKUP_ROOM, int(widest),
                                latency, replay.sampled)


def budget_figure(comparison: TreeComparison) -> Figure:
    """Speed vs mean verified nodes per round, every policy (static: its shapes; dynamic: rho
    swept around the tuned one)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, tuned in comparison.tuned.items():
        if tuned.curve:
            ax.plot(*zip(*tuned.curve), marker=".", label=name,
                    linestyle=":" if name in STATIC else "-")
    ax.axhline(comparison.oracle.speedup, color="black", linestyle="--", label="oracle")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="verified nodes per round (mean)", ylabel="simulated speedup vs ar",
           title="Tree policies on val: speed vs node budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_plot_data(comparison: TreeComparison, folder: Path) -> None:
    for name, tuned in comparison.tuned.items():
        plots.write_csv(folder / "tree_budget" / f"{name}.csv", ["verified_nodes", "speedup"],
                        tuned.curve)
