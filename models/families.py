"""Decision-model families: each predicts P(a drafted token is accepted) from its features.

Every fitted model exposes `predict_proba(X [n, F]) -> [n]`, `save(folder)` (no pickle:
JSON coefficients, a LightGBM booster file, a torch state dict) and `log_model()` (its MLflow
flavour).  Class imbalance: with `class_weight: balanced` each class weighs half of the loss,
and the fitted logit is shifted back by log(w1 / w0), the prior correction that keeps the
probabilities calibrated (the cost-aware rule needs them); `none` fits the rows as they are.
Soft labels y in [0, 1] are fitted as a row of class 1 with weight y plus one of class 0 with
weight 1 - y (logistic regression), as the cross-entropy objective (LightGBM, MLP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from specstop.common.files import write_atomic, write_json

from .fit_data import FitData
from .mlp import fit_mlp


class StopModel(Protocol):
    family: str
    hyperparameters: dict

    def predict_proba(self, X: np.ndarray) -> np.ndarray:  # [n, F] -> [n]
        ...

    def save(self, folder: Path) -> Path:
        ...

    def log_model(self, example: np.ndarray) -> None:  # example: [n, F], one level
        ...


def logistic_proba(X: np.ndarray, mean: np.ndarray, scale: np.ndarray, coef: np.ndarray,
                   intercept: float) -> np.ndarray:
    """[n] P(accept) of the logistic family from its saved numbers (logistic.json)."""
    return 1.0 / (1.0 + np.exp(-(((X - mean) / scale) @ coef + intercept)))


class Logistic:
    """Standardised features, L2 logistic regression (scikit-learn)."""

    family = "logistic"

    def __init__(self, pipeline: Pipeline, hyperparameters: dict) -> None:
        self.pipeline = pipeline
        self.hyperparameters = hyperparameters

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """The saved arithmetic (as exported), not the pipeline's per-call validation."""
        scaler, lr = self.pipeline[0], self.pipeline[-1]
        return logistic_proba(X, scaler.mean_, scaler.scale_, lr.coef_[0], lr.intercept_[0])

    def save(self, folder: Path) -> Path:
        """logistic.json: the scaler (mean, scale) and the coefficients over scaled features."""
        scaler, lr = self.pipeline[0], self.pipeline[-1]
        path = Path(folder) / "logistic.json"
        write_json(path, {"mean": scaler.mean_.tolist(), "scale": scaler.scale_.tolist(),
                          "coef": lr.coef_[0].tolist(), "intercept": float(lr.intercept_[0]),
                          "hyperparameters": self.hyperparameters})
        return path

    def log_model(self, example: np.ndarray) -> None:
        import mlflow.sklearn

        mlflow.sklearn.log_model(self.pipeline, name="model", pip_requirements=["scikit-learn"],
                                 input_example=example)


def fit_logistic(data: FitData, hp: dict, seed: int) -> Logistic:
    n = len(data.y)
    X = np.concatenate([data.X, data.X])
    y = np.concatenate([np.ones(n), np.zeros(n)])
    w = np.concatenate([data.w * data.y, data.w * (1 - data.y)])
    keep = w > 0
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(
        C=float(hp.get("C", 1.0)), max_iter=int(hp.get("max_iter", 1000)), random_state=seed))
    pipeline.fit(X[keep], y[keep], logisticregression__sample_weight=w[keep])
    pipeline[-1].intercept_ -= data.logit_offset
    return Logistic(pipeline, dict(hp))


class LightGBM:
    """Gradient-boosted trees; the prior correction is kept beside the booster."""

    family = "lightgbm"

    def __init__(self, booster, logit_offset: float, hyperparameters: dict) -> None:
        self.booster = booster
        self.logit_offset = logit_offset
        self.hyperparameters = hyperparameters

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        raw = self.booster.predict(X, raw_score=True, num_threads=1)
        return 1.0 / (1.0 + np.exp(-(raw - self.logit_offset)))

    def save(self, folder: Path) -> Path:
        """lightgbm.txt (the booster, raw logit) and lightgbm.json (the logit offset)."""
        path = Path(folder) / "lightgbm.txt"
        write_atomic(path, lambda tmp: self.booster.save_model(str(tmp)))
        write_json(Path(folder) / "lightgbm.json",
                   {"logit_offset": self.logit_offset, "hyperparameters": self.hyperparameters})
        return path

    def log_model(self, example: np.ndarray) -> None:
        import mlflow.lightgbm

        mlflow.lightgbm.log_model(self.booster, name="model", pip_requirements=["lightgbm"],
                                  input_example=example)


def fit_lightgbm(data: FitData, hp: dict, seed: int) -> LightGBM:
    import lightgbm as lgb

    hp = dict(hp)
    rounds = int(hp.pop("n_estimators", 500))
    patience = int(hp.pop("early_stopping_rounds", 30))
    params = {"objective": "cross_entropy", "verbosity": -1, "num_threads": 1, "seed": seed,
              "deterministic": True, **hp}
    train = lgb.Dataset(data.X, data.y, weight=data.w)
    valid = lgb.Dataset(data.X_stop, data.y_stop, weight=data.w_stop, reference=train)
    booster = lgb.train(params, train, num_boost_round=rounds, valid_sets=[valid],
                        callbacks=[lgb.early_stopping(patience, verbose=False)])
    booster = lgb.Booster(model_str=booster.model_to_string(
        num_iteration=booster.best_iteration or rounds))
    return LightGBM(booster, data.logit_offset,
                    {**hp, "n_estimators": rounds, "early_stopping_rounds": patience,
                     "best_iteration": booster.current_iteration()})


FITTERS: dict[str, Callable[[FitData, dict, int], StopModel]] = {
    "logistic": fit_logistic, "lightgbm": fit_lightgbm, "mlp": fit_mlp}


def search_space(family: str, trial) -> dict:
    """Hyperparameters an Optuna trial proposes for a family (overriding params.yaml)."""
    if family == "logistic":
        return {"C": trial.suggest_float("C", 1e-3, 1e2, log=True)}
    if family == "lightgbm":
        return {"num_leaves": trial.suggest_int("num_leaves", 7, 127, log=True),
                "learning_rate": trial.suggest_float("learning_rate", 0.01, 0.2, log=True),
                "min_child_samples": trial.suggest_int("min_child_samples", 10, 300, log=True),
                "feature_fraction": trial.suggest_float("feature_fraction", 0.5, 1.0)}
    return {"hidden": [trial.suggest_int("width", 16, 128, log=True)]
            * trial.suggest_int("layers", 1, 3),
            "lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True),
            "dropout": trial.suggest_float("dropout", 0.0, 0.3)}
