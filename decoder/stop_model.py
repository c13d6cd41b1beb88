"""An exported decision model (TorchScript) as the decode loop's stopping policy.

The file's one interface is `forward(features [N, F] float32) -> P(accept) [N]`; its metadata
(`_extra_files["specstop.json"]`) names the feature list and schema version it was trained on,
the family, the tuned rule and its parameters, the training data digest and the MLflow run.
The rules are those the replay tuned, with the arithmetic both share (`.policy`):

- tree (method `tree`): `tree_rule`, the dynamic tree's expand / verify rule (`.tree_rule`);
  under sampling `sampling_tree_rule` (`.sampling_rule`: children per node from values known
  before they are drawn, exact; tuned on sampled rounds) where the export has one,
  behind the round gate `round_gate` (`.round_gate`; none: every round drafts); `fallback: ar`
  where no drafting policy beat `ar` in the replay on the cost curve it was tuned for: the
  gate then never opens and the loop runs plain `ar`; `static_tree` / `sampling_static_tree`,
  the static shape that replayed faster than the tree greedy / sampled (or, where the two
  replayed close, decoded faster on val prompts: `settled`), which the loop then decodes
  instead (`.methods.with_static_fallback`); `lookup_model`, the lookup chain's
  P(accepted | parent accepted) (`.lookup.LookupModel`) when a round adds the chain, and
  `lookup_branch` / `sampling_lookup_branch`: the tree with the chain decoded faster on val
  prompts (`settled`), so a decode that leaves it to the file adds it (`exported_lookup_branch`);
  `confidence_tree`, the draft's confidence tree's rule where it decoded fastest greedy with the
  chain (`settled`), which a greedy decode with the chain then runs instead of the model's tree
  (`.methods.with_confidence_tree`);
- threshold: continue below a node while p-hat > t;
- cost_aware: continue below a node while P_d * p-hat_d / (c + v)_d > rho: P_d the product of
  p-hat along the node's branch within the round, level d included (reset at depth 1, carried
  to the children through `parents`), p-hat_d standing in for the next token's acceptance, and
  (c + v)_d the marginal cost of drafting level d + 1 (in `ar` steps); beyond the levels the
  cost model covers it stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import check_file
from specstop.features import FEATURES, SCHEMA_VERSION

from .lookup import LookupModel
from .policy import DEPTH, StaticShape, continues, cost_aware_score
from .round_gate import RoundGate
from .tree_rule import TreeRule

STOP_MODEL_META = "specstop.json"
RULES = ("threshold", "cost_aware")
GATE_KEYS = ("round_gate", "fallback", "gated_speedup", "gated_share")  # `models.round_gate`
SAMPLING_KEYS = ("sampling_tree_rule", "sampling_tree_speedup", "sampling_temperature")
STATIC_KEYS = {True: "static_tree", False: "sampling_static_tree"}  # by greedy: the static
# shape decoded instead of the tree (`models.tree_report`), or null
LOOKUP_KEYS = {True: "lookup_branch", False: "sampling_lookup_branch"}  # by greedy: whether the
# tree decodes with the lookup branch where the decode leaves it to the file (`models.settle`)
TREE_WAY, STATIC_WAY, LOOKUP_WAY = "tree", "static tree", "tree with the lookup branch"  # the
# ways the settle decodes (`settled[mode].vs_replay`'s keys), and greedy the confidence tree's:
CONFIDENCE_WAY = "confidence tree with the lookup branch"  # the draft's confidence, no model
BRANCH_WAYS = (LOOKUP_WAY, CONFIDENCE_WAY)  # the ways that decode the lookup branch


def read_stop_model(path: Path) -> tuple[torch.jit.ScriptModule, dict]:
    """(module, metadata) of an exported file; a SpecstopError names the file and the problem."""
    path = check_file(path, f"stop model not found: {path}")
    extra = {STOP_MODEL_META: ""}
    try:
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except (RuntimeError, ValueError) as err:
        reason = first_line(err).split(". ")[0]  # torch appends paragraphs of advice
        raise SpecstopError(f"{path}: not a TorchScript stop model ({reason})") from err
    if not extra[STOP_MODEL_META]:
        raise SpecstopError(f"{path}: no {STOP_MODEL_META} metadata inside (export it with "
                            f"`specstop export`)")
    try:
        meta = json.loads(extra[STOP_MODEL_META])
    except ValueError as err:
        raise SpecstopError(f"{path}: unreadable {STOP_MODEL_META} ({first_line(err)})") from err
    check_feature_schema(meta, path)
    return module.eval(), meta


def check_feature_schema(meta: dict, path: Path) -> None:
    """Refuse a model trained on another feature vector than `specstop.features` computes."""
    version, names = meta.get("feature_schema_version"), meta.get("features")
    ours = [f.name for f in FEATURES]
    if version != SCHEMA_VERSION:
        raise SpecstopError(f"{path}: trained on feature schema version {version}, this specstop "
                            f"computes version {SCHEMA_VERSION}; re-run collect, train and export")
    if names != ours:
        diff = next((i for i, (a, b) in enumerate(zip(names or [], ours)) if a != b),
                    min(len(names or []), len(ours)))
        raise SpecstopError(f"{path}: feature list differs from specstop.features at column "
                            f"{diff} ({len(names or [])} vs {len(ours)} features); re-export it")


class LearnedPolicy:
    """A StoppingPolicy from an exported decision model (batch-first, no `.item()`)."""

    max_levels = None
    reads_features = True

    def __init__(self, module: torch.jit.ScriptModule, meta: dict, source: str = "") -> None:
        self.model = module
        self.meta = meta
        self.rule = meta.get("rule")
        if self.rule not in RULES:
            raise SpecstopError(f"{source or 'stop model'}: unknown rule {self.rule!r} "
                                f"(expected one of {', '.join(RULES)})")
        try:
            self.threshold = float(meta["threshold"])
            self.rho = float(meta["rho"])
            # indexed by level as the replay's: 0 unused, then marginal_cost[d - 1], then stop
            marginal = [float("inf")] + [float(c) for c in meta["marginal_cost"]] + [float("inf")]
            self.name = f"{meta['family']}-{self.rule}"
            self.tree_rule = TreeRule.from_dict(meta["tree_rule"])
            sampling = meta.get("sampling_tree_rule")
            self.sampling_rule = TreeRule.from_dict(sampling) if sampling else None
            self.round_gate = _round_gate(meta)
            self.static_shapes = {greedy: StaticShape.from_dict(meta[key])
                                  for greedy, key in STATIC_KEYS.items() if meta.get(key)}
            lookup = meta.get("lookup_model")
            self.lookup_model = LookupModel.from_dict(lookup) if lookup else None
            self.lookup_branches = {greedy: bool(meta.get(key)) and lookup is not None
                                    for greedy, key in LOOKUP_KEYS.items()}
            confidence = meta.get("confidence_tree") if self.lookup_branches[True] else None
            self.confidence_tree = TreeRule.from_dict(confidence) if confidence else None
        except (KeyError, TypeError, ValueError) as err:
            raise SpecstopError(f"{source or 'stop model'}: incomplete metadata "
                                f"({type(err).__name__}: {err})") from err
        self.marginal = torch.tensor(marginal, dtype=torch.float64)  # [levels + 2] by depth
        self.device = torch.device("cpu")
        self._product: torch.Tensor | None = None  # [n] P_d of the previous call's level
        self.calls = 0
        self.seconds = 0.0  # wall time of the calls (CPU; launches only on a GPU)

    def probabilities(self, features: torch.Tensor) -> torch.Tensor:  # [n, F] -> [n]
        """The model's P(accept) of each row (a `tree` round's decision), counted and timed."""
        start = time.perf_counter()
        p = self._model(features)
        self._count(start)
        return p

    def __call__(self, features: torch.Tensor,
                 parents: torch.Tensor | None = None) -> torch.Tensor:  # [n, F] -> [n] bool
        start = time.perf_counter()
        p = self._model(features)
        if self.rule == "threshold":
            go_on = continues(p, self.threshold)
        else:
            go_on = self._cost_aware(p.double(), features[:, DEPTH], parents)
        self._count(start)
        return go_on

    def _model(self, features: torch.Tensor) -> torch.Tensor:
        if features.device != self.device:  # follow the decoder's device once
            self.model, self.marginal = self.model.to(features.device), \
                self.marginal.to(features.device)
            self.device = features.device
        with torch.inference_mode():
            return self.model(features.float())

    def _count(self, start: float) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - start

    def _cost_aware(self, p: torch.Tensor, depth: torch.Tensor,
                    parents: torch.Tensor | None) -> torch.Tensor:
        """P_d * p / marginal[d - 1] > rho; P_d restarts where depth == 1 (a new round)."""
        first = depth == 1
        if self._product is None or parents is None:
            product = p
        else:
            last = self._product.numel() - 1  # parents of depth-1 rows are roots: any index
            product = torch.where(first, p, self._product[parents.clamp(0, last)] * p)
        self._product = product
        level = depth.long().clamp(1, self.marginal.numel() - 1)
        return continues(cost_aware_score(product, p, self.marginal, level), self.rho)

    def summary(self) -> str:
        per_call = self.seconds / self.calls * 1e3 if self.calls else 0.0
        parameter = (f"threshold {self.threshold:.4g}" if self.rule == "threshold"
                     else f"rho {self.rho:.4g}")
        return (f"stop model: {self.meta['family']}, {self.rule} rule ({parameter}); "
                f"{per_call:.3f} ms per decision over {self.calls} decisions")

    def tree_summary(self, decision_seconds: float, seconds: float, gated: int = 0,
                     rounds: int = 0, greedy: bool = True, lookup_branch: bool = False) -> str:
        """One line on the `tree` method's use of the model (its decisions' share of a run, the
        rounds its gate kept from drafting, the lookup branch beside its tree), or why it ran
        plain `ar`, a static shape (never with a lookup branch: `with_static_fallback`) or the
        draft's confidence tree (greedy with the lookup branch only: `with_confidence_tree`)."""
        family = self.meta["family"]
        shape = self.static_shapes.get(greedy)
        if shape is not None and not lookup_branch:
            static = self.meta[STATIC_KEYS[greedy]]
            tree = self.meta["gated_speedup" if greedy else "sampling_tree_speedup"]
            static_over, tree_over = (self._settled_ratio(greedy, way)
                                      for way in (STATIC_WAY, TREE_WAY))
            why = (f"it decoded {static_over:.3f}x the learned tree's speed "
                   f"{self._settle_note(greedy)}" if static_over
                   else f"the learned tree decoded {tree_over:.3f}x its speed "
                   f"{self._settle_note(greedy)}" if tree_over
                   else f"it beat the learned tree in the replay on its cost curve "
                   f"({static['speedup']:.3f}x ar against {tree:.3f}x)")
            return (f"stop model: {family} decodes the static tree {list(shape.widths)} to depth "
                    f"{shape.depth}: {why}")
        if self.confidence_tree is not None and greedy and lookup_branch:
            rule, over = self.confidence_tree, self._settled_ratio(greedy, CONFIDENCE_WAY)
            why = f": it decoded {over:.3f}x the speed of the replay's choice " \
                f"{self._settle_note(greedy)}" if over else ""
            return (f"stop model: {family} decodes the draft's confidence tree (expand "
                    f"{rule.expand:.3g}, max width {rule.max_width}, rho {rule.rho:.4g}) with the "
                    f"lookup branch{why}")
        if self.round_gate is not None and self.round_gate.never:
            return (f"stop model: {family} falls back to ar: no drafting policy beat ar in the "
                    f"replay on its cost curve (its tree {self.meta['tree_speedup']:.3f}x ar); "
                    f"decoded without drafting")
        rule, share = self.tree_rule, decision_seconds / seconds if seconds > 0 else 0.0
        gate = "" if self.round_gate is None else f", round gate: {gated} of {rounds} rounds " \
            "not drafted"
        chain = ", with the lookup branch" if lookup_branch else ""
        measured = self._settled_ratio(greedy, LOOKUP_WAY)
        if lookup_branch and measured:
            chain += f", {measured:.3f}x the speed of the replay's choice " \
                f"{self._settle_note(greedy)}"
        return (f"stop model: {family}, tree rule (expand {rule.expand:.3g}, max "
                f"width {rule.max_width}, rho {rule.rho:.4g}){chain}; decisions "
                f"{100 * share:.2f}% of the decode time{gate}")

    def _settled(self, greedy: bool) -> dict:
        """What the export's settle measured in a mode (`models.settle`), {} where it did not."""
        return (self.meta.get("settled") or {}).get("greedy" if greedy else "sampling") or {}

    def _settle_note(self, greedy: bool) -> str:
        """Where a settled ratio was measured (only where the export's settle decoded)."""
        return f"on {self._settled(greedy)['prompts']} val prompts (the export's settle)"

    def _settled_ratio(self, greedy: bool, way: str) -> float | None:
        """`way`'s settled speed over the replay's choice's in a mode, None where not measured."""
        return (self._settled(greedy).get("vs_replay", {}).get(way) or {}).get("ratio")


def _round_gate(meta: dict) -> RoundGate | None:
    """The metadata's gate: `fallback: ar` is the closed one; none without either."""
    if meta.get("fallback") == "ar":
        return RoundGate.closed()
    if meta.get("fallback") is not None:
        raise ValueError(f"unknown fallback {meta['fallback']!r} (expected 'ar')")
    return None if meta.get("round_gate") is None else RoundGate.from_dict(meta["round_gate"])


def load_stop_model(path: Path) -> LearnedPolicy:
    """The stopping policy of an exported file (`specstop export`), checked against the schema
    and on a probe batch."""
    module, meta = read_stop_model(path)
    policy = LearnedPolicy(module, meta, str(path))
    for _ in range(2):  # TorchScript profiles the first calls: keep them out of decoding
        check_probabilities(policy, path)
    policy.calls, policy.seconds = 0, 0.0  # the probes are not decisions
    return policy


def probe_batch(rows: int = 3) -> torch.Tensor:
    """[rows, F] features of the schema's width, spread over [0, 1], at depths 1..rows."""
    probe = torch.linspace(0, 1, rows)[:, None].repeat(1, len(FEATURES))
    probe[:, DEPTH] = torch.arange(1, rows + 1, dtype=torch.float32)
    return probe


def check_probabilities(policy: LearnedPolicy, path: Path) -> None:
    """Refuse a model that does not map [N, F] features to N probabilities (finite, in [0, 1])."""
    probe = probe_batch()
    n, width = probe.shape
    try:
        p = policy.probabilities(probe)
    except RuntimeError as err:  # TorchScript's own message is the last line of its traceback
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise SpecstopError(f"{path}: the model does not accept [N, {width}] features "
                            f"({last})") from err
    if not isinstance(p, torch.Tensor) or tuple(p.shape) != (n,):
        shape = list(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        raise SpecstopError(f"{path}: the model returns {shape} for {n} rows, not one "
                            f"probability per row [{n}]")
    if not bool((torch.isfinite(p) & (p >= 0) & (p <= 1)).all()):
        raise SpecstopError(f"{path}: the model returns {p.tolist()} for {n} rows, not "
                            f"probabilities in [0, 1]")
