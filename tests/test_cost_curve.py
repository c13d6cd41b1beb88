"""The one cost curve: how a measured table is read, and that every replay prices a pass at the
width the decode loop really runs it at."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstop.decoder.contracts import Proposal
from specstop.decoder.costs import CostCurve, CostModel, RoundWork
from specstop.decoder.loop import score
from specstop.decoder.sampling import Sampling
from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule
from specstop.replay.tree_replay import TreeCosts

MEASURED = CostCurve({1: 0.0628, 2: 0.0624, 3: 0.0636, 4: 0.0639, 5: 0.0675, 6: 0.0680,
                      8: 0.0694, 12: 0.0746, 16: 0.0846, 24: 0.0919, 32: 0.0974})
# ^ a default run's data/costs/verify.json (embedded target, bf16, 2-core AVX512-BF16 CPU): a
# one-token pass costs more than two tokens, so even `ar` runs padded
UNEVEN = CostCurve({1: 1.0, 2: 0.9, 4: 1.5, 6: 1.6, 8: 1.2, 16: 2.0})  # cheaper wide passes


def test_at_reads_measured_widths_interpolates_between_and_extrapolates_beyond():
    assert UNEVEN.at(0) == 0.0
    assert UNEVEN.at(4) == 1.5 and UNEVEN.at(8) == 1.2  # measured, even where a wider is cheaper
    assert UNEVEN.at(3) == pytest.approx(1.2)  # halfway between 0.9 and 1.5
    assert UNEVEN.at(12) == pytest.approx(1.6)
    assert UNEVEN.at(20) == pytest.approx(2.0 + 4 * 0.1)  # the slope of 8..16
    falling = CostCurve({1: 1.0, 2: 1.51, 4: 1.89, 8: 2.22, 16: 2.65, 24: 5.86, 32: 3.84})
    # ^ an AVX2-only host's table (fp32): a slow shape at 24 tokens, below the widest's slope
    assert falling.at(48) == pytest.approx(3.84 + 16 * (3.84 - 1.0) / 31)  # the mean slope
    assert all(falling.at(n + 1) > falling.at(n) > 3.84 for n in range(33, 80))
    assert CostCurve({1: 1.0, 2: 0.9, 4: 0.8}).at(6) == pytest.approx(0.8)  # never falling
    assert CostCurve({1: 0.5}).at(7) == 1.0  # one width: flat
    assert CostCurve({1: 2.0, 3: 3.0}).at(2) == pytest.approx(1.25)  # in one-token steps


def test_padded_runs_a_measured_width_at_the_cheapest_measured_width_at_least_as_wide():
    assert UNEVEN.padded(1) == (2, 0.9)
    assert UNEVEN.padded(2) == (2, 0.9)
    assert UNEVEN.padded(4) == (8, 1.2) and UNEVEN.padded(6) == (8, 1.2)
    assert UNEVEN.padded(3) == (3, pytest.approx(1.2))  # not measured: run as it is
    assert UNEVEN.padded(16) == (16, 2.0) and UNEVEN.padded(17)[0] == 17
    assert CostCurve({1: 1.0, 2: 1.0}).padded(1) == (1, 1.0)  # a tie: the narrower


def test_price_is_in_ar_steps_as_the_loop_pays_them():
    assert UNEVEN.price(1) == 1.0 and UNEVEN.price(0) == 0.0
    assert UNEVEN.price(4) == pytest.approx(1.2 / 0.9)
    assert UNEVEN.ar_seconds == pytest.approx(0.9)
    assert UNEVEN.prices(5) == pytest.approx([0.0, 1.0, 1.0, 1.2 / 0.9, 1.2 / 0.9, 1.55 / 0.9])
    with pytest.raises(ValueError, match="width 1"):
        CostCurve({2: 1.0})


class WidthProbe:
    """A target that records the width of each pass `score` asks of it."""

    dtype = torch.float32

    def __init__(self) -> None:
        self.widths: list[int] = []

    def extend_with_hidden(self, ids, positions, mask, layers=()):
        self.widths.append(int(ids.shape[0]))
        assert positions.shape[0] == ids.shape[0]
        assert mask is None or mask.shape[-1] == ids.shape[0]
        return torch.zeros(ids.shape[0], 5), None


def runtime_width(curve: CostCurve, n: int) -> int:
    """The width `loop.score` runs a pass over n tokens at (a chain of n - 1 drafted tokens)."""
    tree = Tree(1, (1,) * (n - 1))
    proposal = Proposal(tokens=torch.zeros(n, dtype=torch.long), depth=n - 1, root_position=3,
                        q=torch.zeros(max(n - 1, 1), 5), features=(),
                        fed=torch.arange(n), steps=n - 1, drafted=n - 1)
    probe = WidthProbe()
    score(probe, tree, proposal, Sampling(0.0, 1.0), curve, ())
    (width,) = probe.widths
    return width


@pytest.mark.parametrize("curve", [UNEVEN, MEASURED], ids=["uneven", "measured"])
def test_every_replay_prices_a_pass_at_the_width_score_runs_it_at(curve: CostCurve):
    """The tree replay (and so the exported tree rule), the level-wise replay and the runtime
    agree: a pass over n tokens costs what the width `score` pads it to costs, over the width
    `ar`'s one-token pass runs at."""
    nodes = 40
    paid = np.array([curve.at(runtime_width(curve, n)) for n in range(1, nodes + 2)])
    paid = np.concatenate([[0.0], paid / paid[0]])  # in `ar` steps
    draft = CostCurve({1: 0.1, 2: 0.12})
    sizes = (1, 2, 5, 9, 17, 33)
    model = CostModel(sizes, curve, draft, 0.0)
    tree_costs = TreeCosts.from_model(model, nodes, 1)
    assert tree_costs.verify == pytest.approx(paid)
    rule = tree_costs.rule((2, 1, 1), 0.1, 1.0, 2)
    assert [rule.cost(n) for n in range(1, nodes + 2)] == pytest.approx(paid[1:])
    steps = [model.draft_step(w) for w in np.diff((0, *sizes))[:-1]]  # level d feeds d - 1's
    level_wise = model.round_cost() - np.concatenate([[0.0], np.cumsum(steps)])
    assert level_wise == pytest.approx(paid[list(sizes)])


def test_a_tree_rule_prices_every_pass_it_can_verify():
    """(3, 2) at most 2 fed a level: 3 nodes, then 2 x 2: a pass over up to 1 + 7 tokens."""
    rule = TreeRule((3, 2), 0.1, 1.0, 2, tuple(UNEVEN.prices(8)))
    assert rule.max_nodes == 7 and rule.cost(8) == UNEVEN.price(8)
    with pytest.raises(ValueError, match="price every pass"):
        TreeRule((3, 2), 0.1, 1.0, 2, tuple(UNEVEN.prices(7)))


def test_the_sweeps_prediction_prices_the_pass_as_the_loop_pays_it():
    """sd at gamma 3, alpha 0.5, c 0.1 one-token steps: 1.875 tokens a round over 3 draft steps
    and a pass over 4 tokens (run at 8: 1.2), in `ar` steps (`ar` runs at 2: 0.9)."""
    from specstop.drafts.sweep import _predicted_speedup

    assert _predicted_speedup(0.5, 0.1, 3, UNEVEN) == pytest.approx(1.875 / (0.3 / 0.9 + 1.2 / 0.9))
    assert _predicted_speedup(0.5, 0.1, 3, None) == pytest.approx(1.875 / 1.3)


def test_a_scaled_model_stretches_the_draft_steps_and_the_verify_slope_only():
    draft = CostCurve({1: 0.002, 4: 0.003})
    model = CostModel((1, 4, 10), MEASURED, draft, 0.001, (RoundWork(0.1), RoundWork(0.2, 0.1)),
                      (RoundWork(0.05), RoundWork(0.1)))
    assert model.scaled() == model
    scaled = model.scaled(draft=3.0, verify_slope=4.0)
    assert scaled.draft.seconds == {1: pytest.approx(0.006), 4: pytest.approx(0.009)}
    assert scaled.target.step == MEASURED.step
    for n in (2, 8, 32):
        assert scaled.target.at(n) - 1 == pytest.approx(4 * (MEASURED.at(n) - 1))
    assert (scaled.decision, scaled.tree_overhead, scaled.static_overhead) == \
        (model.decision, model.tree_overhead, model.static_overhead)
    assert scaled.draft_step(1) > model.draft_step(1)
