"""The replay simulator, the oracle and the tuned stopping rules, on hand-made and synthetic
rounds."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from specstop.common.errors import DataError
from specstop.collection import data
from specstop.replay import rules
from specstop.decoder.costs import CostCurve, CostModel
from specstop.replay.simulate import Replay

from synthetic_rows import make_collect

COSTS = CostModel((1, 4, 7, 10), CostCurve({1: 1.0, 4: 1.3, 10: 1.9}), CostCurve({1: 0.1, 3: 0.2}),
                  0.0)


def ti_round(round_index: int, labels: list[list[int]], soft: list[list[float]] | None = None,
             width: int = 3) -> pd.DataFrame:
    """Rows of one round of a W-candidate tree (chains below level 1), level-major."""
    rows = []
    for level, level_labels in enumerate(labels, start=1):
        for b, label in enumerate(level_labels):
            node = (level - 1) * width + b + 1
            rows.append({"prompt_id": "p", "round": round_index, "node": node,
                         "parent": 0 if level == 1 else node - width, "depth": float(level),
                         "label": label,
                         "soft_label": soft[level - 1][b] if soft else float(label == 1)})
    return pd.DataFrame(rows)


def chain_rows(soft: list[float]) -> pd.DataFrame:
    """One round of a single chain (sd): node d at level d."""
    return pd.DataFrame({"prompt_id": "p", "round": 0, "node": np.arange(1, len(soft) + 1),
                         "parent": np.arange(len(soft)), "depth": np.arange(1, len(soft) + 1.0),
                         "label": -1, "soft_label": soft})


def test_cost_model_interpolates_and_charges_each_level():
    cost = COSTS.round_cost()
    # D draft steps (level 1 from the lone root: width 1, deeper: width 3) + target at size(D)
    assert cost == pytest.approx([1.0, 0.1 + 1.3, 0.3 + 1.6, 0.5 + 1.9])  # 7: interpolated
    assert COSTS.marginal_cost()[1] == pytest.approx(cost[2] - cost[1])
    assert COSTS.round_cost(extra=0.05)[3] == pytest.approx(cost[3] + 0.15)


def test_cost_model_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="costs.json: cost model not found"):
        CostModel.load(tmp_path / "costs.json")
    (tmp_path / "costs.json").write_text(json.dumps({"tree_sizes": [1, 4]}))
    with pytest.raises(DataError, match="costs.json: not a cost model"):
        CostModel.load(tmp_path / "costs.json")


def test_hard_gain_is_accepted_levels_cut_at_depth():
    rows = pd.concat([ti_round(0, [[0, 1, 0], [-1, 1, -1], [-1, 0, -1]]),
                      ti_round(1, [[0, 0, 0], [-1, -1, -1], [-1, -1, -1]])])
    replay = Replay.from_rows(rows, "hard")
    assert replay.gain.tolist() == [[0, 1, 2, 2], [0, 0, 0, 0]]
    assert replay.first_rejection().tolist() == [3, 1]
    assert replay.oracle(COSTS).tolist() == [2, 1]  # max(a, 1): no wasted level


def test_soft_gain_of_a_chain_is_the_sum_of_prefix_products():
    s = [0.9, 0.5, 0.8]
    replay = Replay.from_rows(chain_rows(s), "soft")
    expected = np.cumsum(np.cumprod(s))
    assert replay.gain[0, 1:] == pytest.approx(expected)


def test_soft_gain_tries_candidates_in_rank_order():
    soft = [[0.5, 0.4, 0.0], [1.0, 0.5, 0.0]]
    replay = Replay.from_rows(ti_round(0, [[0, 0, 0], [-1, -1, -1]], soft), "soft")
    level1 = 0.5 + 0.5 * 0.4
    assert replay.gain[0, 1] == pytest.approx(level1)
    assert replay.gain[0, 2] == pytest.approx(0.5 * (1 + 1.0) + 0.5 * 0.4 * (1 + 0.5))


def test_policy_goes_on_while_any_node_of_the_level_says_so():
    rows = ti_round(0, [[0, 1, 0], [-1, 1, -1], [-1, 0, -1]])
    replay = Replay.from_rows(rows, "hard")
    score = np.array([0.1, 0.9, 0.1, 0.1, 0.4, 0.2, 0.9, 0.9, 0.9])  # per row
    assert replay.cut(replay.level_max(score) > 0.5).tolist() == [2]
    assert replay.cut(replay.level_max(score) > 0.0).tolist() == [3]  # capped at the tree
    result = replay.simulate(np.array([2]), COSTS)
    assert result.speedup == pytest.approx(3 / COSTS.round_cost()[2])
    assert result.wasted_steps == 0 and result.tokens_per_call == 3


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = make_collect(tmp_path_factory.mktemp("collect"), prompts={"train": 2, "val": 8},
                          rounds=30)
    split = data.load(folder).val
    return split, Replay.from_rows(split.rows, "hard"), CostModel.load(folder / "costs.json")


def test_oracle_bounds_every_rule(synthetic):
    split, replay, costs = synthetic
    oracle = replay.simulate(replay.oracle(costs), costs).speedup
    static = rules.best_fixed(replay, costs)
    q = split.rows["q_token"].to_numpy()
    tuned = rules.tune_threshold(replay, costs, q, grid=50)
    assert static.result.speedup <= tuned.result.speedup <= oracle
    assert all(s <= oracle + 1e-12 for _, s in tuned.curve + static.curve)


def test_cost_aware_rule_with_true_probabilities_stops_at_the_first_rejection(synthetic):
    split, replay, costs = synthetic
    truth = (split.rows["label"] == 1).to_numpy(float)
    static = rules.best_fixed(replay, costs).result.speedup
    tuned = rules.tune_cost_aware(replay, costs, truth, static, iterations=5, grid=20)
    first = replay.simulate(replay.first_rejection(), costs)
    assert tuned.result.speedup == pytest.approx(first.speedup)
    assert tuned.result.speedup > static


def test_dinkelbach_rho_is_a_fixed_point_with_calibrated_probabilities(synthetic):
    split, replay, costs = synthetic
    p = split.rows["q_token"].to_numpy() ** 2  # the generator's acceptance probability
    static = rules.best_fixed(replay, costs).result.speedup
    tuned = rules.tune_cost_aware(replay, costs, p, static, iterations=10, grid=50)
    assert tuned.result.speedup >= static
    best_swept = max(s for _, s in tuned.curve)
    assert tuned.result.speedup >= 0.97 * best_swept
