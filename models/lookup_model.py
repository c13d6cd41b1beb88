"""The lookup chain's decision model: a logistic P(chain token accepted | the tokens before it
were) on `decoder.lookup.LOOKUP_FEATURES`, fitted on the train prompts' logged rounds' chains
(those the runtime adds), scored on val's."""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from specstop.decoder.lookup import LOOKUP_FEATURES, LookupModel


def examples(chains: pd.DataFrame, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(X [m, len(LOOKUP_FEATURES)], y [m]) of a split's labelled chain rows the runtime adds
    (those of the logged rounds)."""
    rows = chains[(chains["split"] == split) & (chains["label"] >= 0) & (chains["round"] >= 0)]
    return rows[list(LOOKUP_FEATURES)].to_numpy(np.float64), rows["label"].to_numpy() == 1


def fit(chains: pd.DataFrame, seed: int = 0) -> tuple[LookupModel | None, dict]:
    """The model fitted on the train chains, and its metrics on val (rows, acceptance, AUC);
    None where the train chains hold one class only."""
    X, y = examples(chains, "train")
    X_val, y_val = examples(chains, "val")
    metrics = {"train_rows": int(len(y)), "val_rows": int(len(y_val)),
               "train_acceptance": float(y.mean()) if len(y) else None,
               "val_acceptance": float(y_val.mean()) if len(y_val) else None}
    if len(np.unique(y)) < 2:
        return None, {**metrics, "val_auc": None}
    fitted = LogisticRegression(max_iter=1000, random_state=seed).fit(X, y)
    model = LookupModel(tuple(float(w) for w in fitted.coef_[0]), float(fitted.intercept_[0]))
    auc = float(roc_auc_score(y_val, model.probabilities(X_val))) \
        if len(np.unique(y_val)) == 2 else None
    return model, {**metrics, "val_auc": auc}
