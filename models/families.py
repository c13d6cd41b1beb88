"""Decision-model families: each predicts P(a drafted token is accepted) from its features.

Every fitted model exposes `predict_proba(X [n, F]) -> [n]`, `save(folder)` (no pickle:
JSON coefficients, a LightGBM booster file, a torch state dict) and `log_model()` (its MLflow
flavour).  Class imbalance: with `class_weight: balanced` each class weighs half of the loss,
and the fitted logit is shifted back by log(w1 / w0), the prior correction that keeps the
probabilities calibrated (the cost-aware rule needs them); `none` fits the rows as they are.
Soft labels y in [0, 1] are fitted as a row of class 1 with weight y plus one of class 0 with
weight 1 - y (logistic regression), as the cross-entropy objective (LightGBM, MLP).  Every
family starts from the draft's own confidence, the anchor (`anchor.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from sklearn.linear_model import LogisticRegression
from scipy.optimize import minimize
from scipy.special import expit
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from specstop.common.files import write_atomic, write_json

from .anchor import Anchor
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
                   intercept: float, anchor: Anchor) -> np.ndarray:
    """[n] P(accept) of the logistic family from its saved numbers (logistic.json)."""
    return 1.0 / (1.0 + np.exp(-(((anchor.with_logit(X) - mean) / scale) @ coef + intercept)))


class Logistic:
    """The features and the anchor's logit, standardised; L2 logistic regression
    (scikit-learn)."""

    family = "logistic"

    def __init__(self, pipeline: Pipeline, anchor: Anchor, hyperparameters: dict) -> None:
        self.pipeline = pipeline
        self.anchor = anchor
        self.hyperparameters = hyperparameters

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """The saved arithmetic (as exported), not the pipeline's per-call validation."""
        scaler, lr = self.pipeline[-2], self.pipeline[-1]
        return logistic_proba(X, scaler.mean_, scaler.scale_, lr.coef_[0], lr.intercept_[0],
                              self.anchor)

    def save(self, folder: Path) -> Path:
        """logistic.json: the anchor, the scaler (mean, scale) of the features and the anchor's
        logit (last), and the coefficients over the scaled columns."""
        scaler, lr = self.pipeline[-2], self.pipeline[-1]
        path = Path(folder) / "logistic.json"
        write_json(path, {"anchor": self.anchor.as_dict(), "mean": scaler.mean_.tolist(),
                          "scale": scaler.scale_.tolist(), "coef": lr.coef_[0].tolist(),
                          "intercept": float(lr.intercept_[0]),
                          "hyperparameters": self.hyperparameters})
        return path

    def log_model(self, example: np.ndarray) -> None:
        import mlflow.sklearn

        anchor = f"{Anchor.__module__}.{Anchor.__qualname__}"  # the pipeline's first step
        mlflow.sklearn.log_model(self.pipeline, name="model", pip_requirements=["scikit-learn"],
                                 input_example=example,
                                 skops_trusted_types=[anchor, f"{anchor}.with_logit"])


def fit_logistic(data: FitData, hp: dict, seed: int) -> Logistic:
    """L2 logistic regression on the standardised features with the anchor's logit as an offset,
    so the penalty shrinks the model towards the anchor (scipy's L-BFGS: scikit-learn's has no
    offset; deterministic, `seed` unused).  Kept as a scikit-learn pipeline whose last column,
    the anchor's logit, weighs 1 unscaled."""
    C, max_iter = float(hp.get("C", 1.0)), int(hp.get("max_iter", 1000))
    X, y, w = (a.astype(np.float64) for a in (data.X, data.y, data.w))
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0  # as StandardScaler
    Z, offset = (X - mean) / scale, data.anchor.logit(data.X)

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = Z @ theta[:-1] + theta[-1] + offset
        residual = w * (expit(z) - y)
        value = np.sum(w * (np.logaddexp(0, z) - y * z)) + theta[:-1] @ theta[:-1] / (2 * C)
        return value, np.append(Z.T @ residual + theta[:-1] / C, residual.sum())

    theta = minimize(loss, np.zeros(Z.shape[1] + 1), jac=True, method="L-BFGS-B",
                     options={"maxiter": max_iter}).x
    pipeline = _anchored_pipeline(data.anchor, mean, scale, theta[:-1],
                                  theta[-1] - data.logit_offset, C, len(y))
    return Logistic(pipeline, data.anchor, dict(hp))


def _anchored_pipeline(anchor: Anchor, mean: np.ndarray, scale: np.ndarray, coef: np.ndarray,
                       intercept: float, C: float, rows: int) -> Pipeline:
    """The fitted numbers as a scikit-learn pipeline (its MLflow flavour): the anchor's logit
    appended as a column, standardised with mean 0 and scale 1, weighing 1."""
    features = len(mean) + 1
    scaler = StandardScaler()
    scaler.mean_, scaler.scale_ = np.append(mean, 0.0), np.append(scale, 1.0)
    scaler.var_, scaler.n_features_in_, scaler.n_samples_seen_ = scaler.scale_ ** 2, features, rows
    lr = LogisticRegression(C=C)
    lr.coef_, lr.intercept_ = np.append(coef, 1.0)[None], np.array([intercept])
    lr.classes_, lr.n_features_in_ = np.array([0.0, 1.0]), features
    return Pipeline([("anchor", FunctionTransformer(anchor.with_logit).fit(mean[None])),
                     ("scaler", scaler), ("logisticregression", lr)])


class LightGBM:
    """Gradient-boosted trees boosted from the anchor; the anchor and the prior correction are
    kept beside the booster."""

    family = "lightgbm"

    def __init__(self, booster, anchor: Anchor, logit_offset: float, hyperparameters: dict
                 ) -> None:
        self.booster = booster
        self.anchor = anchor
        self.logit_offset = logit_offset
        self.hyperparameters = hyperparameters

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        raw = self.booster.predict(X, raw_score=True, num_threads=1) + self.anchor.logit(X)
        return 1.0 / (1.0 + np.exp(-(raw - self.logit_offset)))

    def save(self, folder: Path) -> Path:
        """lightgbm.txt (the booster: the logit's correction to the anchor) and lightgbm.json
        (the anchor and the logit offset)."""
        path = Path(folder) / "lightgbm.txt"
        write_atomic(path, lambda tmp: self.booster.save_model(str(tmp)))
        write_json(Path(folder) / "lightgbm.json",
                   {"anchor": self.anchor.as_dict(), "logit_offset": self.logit_offset,
                    "hyperparameters": self.hyperparameters})
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
    train = lgb.Dataset(data.X, data.y, weight=data.w, init_score=data.anchor.logit(data.X))
    valid = lgb.Dataset(data.X_stop, data.y_stop, weight=data.w_stop,
                        init_score=data.anchor.logit(data.X_stop), reference=train)
    booster = lgb.train(params, train, num_boost_round=rounds, valid_sets=[valid],
                        callbacks=[lgb.early_stopping(patience, verbose=False)])
    booster = lgb.Booster(model_str=booster.model_to_string(
        num_iteration=booster.best_iteration or rounds))
    return LightGBM(booster, data.anchor, data.logit_offset,
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
