"""The decode loop: one function, numbered steps, for `ar`, `sd`, `mcsd` and `ti-mcsd`.

State between rounds is the target's KV cache (every committed token) and `r`, the distribution
the next token is drawn from.  A round (1) draws the root(s) from r, (2) drafts the tree below
them level by level until the stopping policy or the tree's depth says stop, (3) scores the
tree in one target pass under the sliced tree mask, (4) verifies, (5) keeps the accepted path in
both caches.  `ar` is the same loop with nothing drafted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from specstop.common.params import METHODS
from specstop.features import RoundContext, draft_features, feature_index

from .costs import VerifyCosts
from .drafter import Drafter, draft_children
from .kv import KVModel
from .policy import FixedDepth, StoppingPolicy
from .sampling import Sampling, sample, warp
from .tree import Tree
from .verify import dynasd_select, verify_tree

MAX_DEPTH = 64
MAX_TREE_NODES = 4096
PATH_CONFIDENCE = feature_index("path_confidence")


@dataclass(frozen=True)
class DecodeConfig:
    method: str = "sd"
    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    max_depth: int = 8  # deepest tree level the mask is built for
    mcsd_branching: tuple[int, ...] = (2, 2)  # leading widths of the mcsd tree, then 1s
    ti_width: int = 3  # branches of ti-mcsd
    lossy: bool = False  # ti-mcsd only: the published DynaSD selection
    without_replacement: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if self.lossy and self.method != "ti-mcsd":
            raise ValueError("--lossy applies to ti-mcsd only")
        if self.max_new_tokens < 1 or self.max_depth < 1:
            raise ValueError("max_new_tokens and max_depth must be >= 1")
        if self.max_depth > MAX_DEPTH:
            raise ValueError(f"max_depth must be <= {MAX_DEPTH}, got {self.max_depth}")
        if self.ti_width < 1 or any(k < 1 for k in self.mcsd_branching):
            raise ValueError(f"ti_width and mcsd_branching must be >= 1, got {self.ti_width} "
                             f"and {list(self.mcsd_branching)}")
        roots, branching = _tree_shape(self)
        nodes = level = roots
        for k in branching:
            level *= k
            nodes += level
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"the {self.method} tree would have {nodes} nodes "
                             f"(at most {MAX_TREE_NODES}); lower the widths or max_depth")


@lru_cache(maxsize=64)
def tree_for(config: DecodeConfig) -> Tree:
    """The largest tree of a method; each round drafts a leading slice of it."""
    return Tree(*_tree_shape(config))


def _tree_shape(config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
    """(roots, children per node at levels 1..max_depth) of a method's largest tree."""
    d = config.max_depth
    if config.method == "ar":
        return 1, ()
    if config.method == "sd":
        return 1, (1,) * d
    if config.method == "mcsd":
        widths = tuple(config.mcsd_branching[:d])
        return 1, widths + (1,) * (d - len(widths))
    if config.lossy:  # the target's top-W tokens start W chains
        return config.ti_width, (1,) * d
    return 1, (config.ti_width,) + (1,) * (d - 1)  # exact: prune to the target's own root


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_calls: int = 0  # the prefill included
    draft_steps: int = 0
    drafted_levels: int = 0  # tree levels drafted (one per step)
    drafted_tokens: int = 0  # tree nodes drafted
    accepted: int = 0  # drafted tokens accepted
    seconds: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens generated per target call."""
        return self.new_tokens / max(self.target_calls, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens per drafted level (at most one node of a level is accepted)."""
        return self.accepted / max(self.drafted_levels, 1)

    def add(self, other: "DecodeStats") -> None:
        """Accumulate another generation's counts (per-round history is not kept)."""
        for name in ("new_tokens", "target_calls", "draft_steps", "drafted_levels",
                     "drafted_tokens", "accepted", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> str:
        return (f"{self.tokens_per_s:.2f} tokens/s, {self.mean_accepted:.2f} accepted tokens per "
                f"target call, acceptance rate {self.acceptance_rate:.3f}")


@dataclass(frozen=True)
class RoundRecord:
    """What the feature hook receives for every drafted token of a round (n drafted tokens)."""

    round: int
    tokens: torch.Tensor  # [n] long
    depth: torch.Tensor  # [n] long, 1 = first drafted level
    parent: torch.Tensor  # [n] long, tree index of the parent (roots are 0..W-1)
    node: torch.Tensor  # [n] long, tree index of the token
    branch: torch.Tensor  # [n] long, its branch (Tree.branch)
    features: torch.Tensor  # [n, F] float32
    labels: torch.Tensor  # [n] int8: 1 accepted, 0 rejected, -1 after an earlier rejection
    p_target: torch.Tensor  # [n] target probability of the token at its parent
    q_draft: torch.Tensor  # [n] draft probability of the token at its parent


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    stats: DecodeStats


FeatureHook = Callable[[RoundRecord], None]


def generate(
    target: KVModel,
    drafter: Drafter | None,
    prompt: torch.Tensor,  # [L] long
    config: DecodeConfig,
    policy: StoppingPolicy | None = None,
    eos_id: int | None = None,
    hook: FeatureHook | None = None,
    generator: torch.Generator | None = None,
    costs: VerifyCosts | None = None,
) -> Generation:
    """Decode up to `config.max_new_tokens` tokens after `prompt`.

    `costs` (measured verification cost by width) lets each target pass be padded to a cheaper
    width; `hook` receives a RoundRecord per round (nothing is recorded without it).
    """
    tree = tree_for(config)
    if tree.max_depth > 0 and drafter is None:
        raise ValueError(f"method '{config.method}' needs a drafter")
    policy = policy or FixedDepth(max(tree.max_depth, 1))
    sampling, stats, out = config.sampling, DecodeStats(), []
    start = time.perf_counter()
    target.reset()
    wants_hidden = drafter is not None and drafter.needs_target_hidden

    # 0. Prefill: the target caches the prompt; r is its next-token distribution.
    logits, hidden = target.extend_with_hidden(prompt, torch.arange(prompt.shape[0]), None,
                                               last_only=True)
    r = warp(logits, sampling)[0]
    if drafter is not None:
        drafter.reset(prompt, hidden if wants_hidden else None)
    stats.target_calls += 1
    while True:
        # 1. Roots: the committed draw from r (exact), or the target's top-W (lossy ti-mcsd).
        roots = _draw_roots(r, tree.roots, sampling, config.lossy, generator)
        if not config.lossy:
            out.append(int(roots[0]))
            if out[-1] == eos_id or len(out) >= config.max_new_tokens:
                break
        budget = config.max_new_tokens - len(out) - (1 if config.lossy else 0)
        root_position = target.length

        # 2. Draft the tree below the roots, level by level, while the policy says go on.
        tokens, q_rows, features = roots, [], []
        context = RoundContext(len(out), stats.accepted_per_round[-1] if stats.accepted_per_round
                               else 0, stats.acceptance_rate)
        depth = 0
        if drafter is not None:
            depth_cap = min(tree.max_depth, budget)
            root_rank = torch.arange(tree.roots, device=r.device)
            root_prob = r[roots]
            confidence = torch.ones(tree.roots, device=r.device)
            while depth < depth_cap:
                logits = drafter.step(tree, depth, tokens[tree.level(depth)], root_position)
                q = warp(logits, sampling)  # [n_depth, V]
                kids = draft_children(q, tree.branching[depth], sampling,
                                      config.without_replacement, generator)
                roots_of_kids = tree.root[tree.level(depth + 1)].to(r.device)
                level_features = draft_features(q, kids, depth + 1, root_rank[roots_of_kids],
                                                root_prob[roots_of_kids], confidence, context)
                confidence = level_features[:, PATH_CONFIDENCE]
                tokens = torch.cat([tokens, kids.flatten()])
                q_rows.append(q)
                features.append(level_features)
                depth += 1
                stats.draft_steps += 1
                parents = tree.parent_row[tree.level(depth)].to(r.device)
                if not bool(policy(level_features, parents).any()):
                    break

        # 3. Score: one target pass over the tree cut at `depth`, under the sliced mask,
        #    padded to the cheapest measured width (padding rows see only themselves).
        n = tree.size(depth)
        ids, positions, mask = _padded_pass(tree, depth, tokens, root_position,
                                            costs.padded_width(n) if costs else n)
        logits, hidden = target.extend_with_hidden(ids, positions, mask)
        p = warp(logits[:n], sampling)  # [n, V]
        stats.target_calls += 1
        q_all = torch.cat(q_rows) if q_rows else p[:0]

        # 4. Verify.
        if config.lossy:
            verdict = dynasd_select(tree, depth, tokens, p, q_all, sampling, eos_id, generator)
        else:
            verdict = verify_tree(tree, depth, tokens, p, q_all, sampling,
                                  config.without_replacement, eos_id, generator)

        # 5. Keep the accepted path in both caches; emit its tokens.
        path = torch.tensor(verdict.path, dtype=torch.long)
        target.retain(torch.cat([torch.arange(root_position), root_position + path]))
        if drafter is not None:
            drafter.commit(tree, depth, verdict.path, tokens, hidden[:n] if wants_hidden else None)
        path_tokens = tokens[path.to(tokens.device)].tolist()
        out.extend(path_tokens if config.lossy else path_tokens[1:])
        accepted = len(verdict.path) - 1
        stats.accepted += accepted
        stats.accepted_per_round.append(accepted)
        stats.drafted_levels += depth
        stats.drafted_tokens += n - tree.roots
        if hook is not None and depth > 0:
            hook(_round_record(len(stats.accepted_per_round) - 1, tree, n, tokens, p, q_all,
                               torch.cat(features), verdict.labels))
        if verdict.next_dist is None or len(out) >= config.max_new_tokens:
            break
        r = verdict.next_dist

    del out[config.max_new_tokens:]
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start
    return Generation(out, stats)


def _padded_pass(tree: Tree, depth: int, tokens: torch.Tensor, root_position: int,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids [width], positions [width], tail mask [width, width] (None for a lone token)."""
    n = tree.size(depth)
    positions = root_position + tree.depth[:n]
    if width == 1:
        return tokens, positions, None
    pad = width - n
    mask = torch.block_diag(tree.sliced_mask(depth), torch.eye(pad, dtype=torch.bool))
    ids = torch.cat([tokens, tokens[:1].expand(pad)])
    return ids, torch.cat([positions, positions[:1].expand(pad)]), mask


def _draw_roots(r: torch.Tensor, width: int, sampling: Sampling, lossy: bool,
                generator: torch.Generator | None) -> torch.Tensor:
    """[width] root tokens: one draw from r (exact), or the top-W / W draws without replacement."""
    if not lossy:
        token = int(torch.argmax(r)) if sampling.greedy else sample(r.float(), generator)
        return torch.tensor([token], device=r.device)
    return draft_children(r[None].float(), width, sampling, True, generator)[0]


def _round_record(index: int, tree: Tree, n: int, tokens: torch.Tensor, p: torch.Tensor,
                  q: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> RoundRecord:
    drafted = torch.arange(tree.roots, n)
    parent = tree.parent[drafted]
    kids = tokens[drafted.to(tokens.device)]
    return RoundRecord(
        round=index,
        tokens=kids.cpu(),
        depth=tree.depth[drafted],
        parent=parent,
        node=drafted,
        branch=tree.branch[drafted],
        features=features.cpu(),
        labels=labels[drafted],
        p_target=p[parent.to(p.device), kids].float().cpu(),
        q_draft=q[parent.to(q.device), kids].float().cpu(),
    )
