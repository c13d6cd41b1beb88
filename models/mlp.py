"""The small MLP family: one `nn.Module` (standardisation inside, the anchor's logit plus a
learned correction out) trained by a LightningModule with early stopping on the held-out
prompts' loss and best-checkpoint restore; the same module is saved (safetensors) and exported
later."""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from specstop.common.files import write_atomic, write_json

from .anchor import Anchor
from .fit_data import FitData


class StopNet(nn.Module):
    """features [n, F] -> logit [n] of P(accepted): the anchor's plus a correction, whose head
    starts at zero (the net starts as the anchor); the feature scaling is part of the net."""

    def __init__(self, n_features: int, hidden: list[int], dropout: float, anchor: Anchor
                 ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        layers, width = [], n_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.anchor = anchor.module()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, F] -> [n]
        return self.anchor(x) + self.head(self.body((x - self.mean) / self.std)).squeeze(-1)


class StopModule(pl.LightningModule):
    """Weighted binary cross-entropy (soft targets allowed) on an injected StopNet."""

    def __init__(self, net: StopNet, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.net = net
        self.save_hyperparameters(ignore=["net"])

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y, w = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y, reduction="none")
        loss = (loss * w).sum() / w.sum()
        self.log(f"{stage}_loss", loss, on_epoch=True, on_step=False, batch_size=len(y))
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                 weight_decay=self.hparams.weight_decay)


class MLP:
    family = "mlp"

    def __init__(self, net: StopNet, anchor: Anchor, hyperparameters: dict) -> None:
        self.net = net.eval()
        self.anchor = anchor
        self.hyperparameters = hyperparameters

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return torch.sigmoid(self.net(torch.tensor(X, dtype=torch.float32))).numpy()

    def save(self, folder: Path) -> Path:
        """mlp.safetensors (the StopNet state) and mlp.json (its constructor arguments, the
        anchor among them)."""
        path = Path(folder) / "mlp.safetensors"
        state = {k: v.contiguous() for k, v in self.net.state_dict().items()}
        write_atomic(path, lambda tmp: save_file(state, str(tmp)))
        write_json(Path(folder) / "mlp.json",
                   {"n_features": int(self.net.mean.numel()),
                    "hidden": list(self.hyperparameters["hidden"]),
                    "dropout": float(self.hyperparameters["dropout"]),
                    "anchor": self.anchor.as_dict(), "hyperparameters": self.hyperparameters})
        return path

    def log_model(self, example: np.ndarray) -> None:
        import mlflow.pytorch

        mlflow.pytorch.log_model(self.net, name="model", pip_requirements=["torch"],
                                 input_example=example)


def fit_mlp(data: FitData, hp: dict, seed: int) -> MLP:
    """Train until the held-out loss stops improving; restore the best checkpoint."""
    hp = {"hidden": [64, 64], "dropout": 0.1, "lr": 1e-3, "weight_decay": 1e-4,
          "batch_size": 1024, "max_epochs": 30, "patience": 4, **hp}
    pl.seed_everything(seed, verbose=False)
    net = StopNet(data.X.shape[1], list(hp["hidden"]), float(hp["dropout"]), data.anchor)
    net.mean.copy_(torch.as_tensor(data.X.mean(axis=0)))
    net.std.copy_(torch.as_tensor(data.X.std(axis=0)).clamp_min(1e-6))
    module = StopModule(net, float(hp["lr"]), float(hp["weight_decay"]))
    with tempfile.TemporaryDirectory() as folder, _quiet():
        best = pl.callbacks.ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=1)
        trainer = pl.Trainer(
            max_epochs=int(hp["max_epochs"]), accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            deterministic=True, callbacks=[best, pl.callbacks.EarlyStopping(
                "val_loss", patience=int(hp["patience"]))])
        trainer.fit(module, _loader(data.X, data.y, data.w, int(hp["batch_size"]), True),
                    _loader(data.X_stop, data.y_stop, data.w_stop, 8192, False))
        state = torch.load(best.best_model_path, weights_only=True)["state_dict"]
    module.load_state_dict(state)
    with torch.no_grad():
        net.head.bias -= data.logit_offset
    return MLP(net, data.anchor, hp)


def _loader(X: np.ndarray, y: np.ndarray, w: np.ndarray, batch: int, shuffle: bool):
    tensors = [torch.as_tensor(a, dtype=torch.float32) for a in (X, y, w)]
    return DataLoader(TensorDataset(*tensors), batch_size=batch, shuffle=shuffle)


class _quiet:
    """Silence Lightning's banner and its single-process data-loader advice."""

    def __enter__(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        self._level = logging.getLogger("pytorch_lightning").level
        logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)

    def __exit__(self, *exc) -> None:
        logging.getLogger("pytorch_lightning").setLevel(self._level)
        self._warnings.__exit__(*exc)
