"""The offline replay: logged rounds replayed under a cost model, level-wise stopping rules
(simulate.py) and their tuning (rules.py), tree policies on superset rounds (tree_replay.py).

Reads the logged rows (`collection`) and shares the runtime's rules (`decoder`), so what the
replay tunes is what the runtime applies; never the decision models, drafts or the CLI."""
