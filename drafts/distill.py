"""Distil a draft from the target with PyTorch Lightning (either family, one module).

Both families learn the teacher's top-k next-token distribution (cross-entropy over the
draft's pruned vocabulary); the feature-conditioned head also regresses the target's next
hidden state (EAGLE's smooth-L1 feature loss), which is what it feeds itself at deeper levels,
and is trained as it is used: `unroll` passes, each fed the previous pass's predicted features
(EAGLE-3's training-time test).  The learning rate anneals on a cosine towards whichever
budget, steps or minutes, ends the run.  A checkpoint after every validation lets an
interrupted run resume exactly: the checkpoint holds the position in the epoch's batch order
and the global RNG states, so a resumed run trains on the same batches with the same noise as
an uninterrupted one (and, where the step budget ends it first, at the same learning rates).
Early stopping watches val alpha (greedy agreement on the held-out responses) and the best
weights are kept; metrics, the learning curve against seconds and tokens seen among them, go
to MLflow.
"""

from __future__ import annotations

import math
import random
import signal
from pathlib import Path
from typing import Iterator

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from specstop.common.params import DraftTrainConfig
from specstop.decoder.load import native_bf16, resolve_device  # accelerator="auto"

from .corpus import RESPONSE, Sequence


def resolve_precision(precision: str, device: torch.device) -> str:
    """Lightning's precision for `precision`: 'auto' trains in bf16-mixed only where bf16 is
    native (the rule `models.dtype: auto` follows), else in 32-true."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if native_bf16(device) else "32-true"


class DraftDistiller(pl.LightningModule):
    """Teacher-forced distillation of a compact draft or a feature-conditioned head."""

    def __init__(self, draft: torch.nn.Module, family: str, vocab_ids: torch.Tensor | None,
                 vocab_size: int, config: DraftTrainConfig,
                 corpus_layers: tuple[int, ...] = (-1,)) -> None:
        super().__init__()
        self.draft, self.family, self.config = draft, family, config
        if family == "feature" and config.frozen_lm_head:  # EAGLE's frozen LM head: the
            draft.lm_head.requires_grad_(False)  # predicted feature must read as the target's
        # where the corpus' hidden states [.., L, H] hold the last layer, and the head's input
        self.last_index = corpus_layers.index(-1)
        self.input_index = [corpus_layers.index(i) for i in getattr(draft, "target_layers", ())]
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))  # checkpointed
        self.register_buffer("text_tokens_seen", torch.zeros((), dtype=torch.long))  # of those,
        # in teacher-forced text
        ids = torch.arange(vocab_size) if vocab_ids is None else vocab_ids
        to_pruned = torch.full((vocab_size,), -1, dtype=torch.long)
        to_pruned[ids] = torch.arange(ids.shape[0])
        self.register_buffer("to_pruned", to_pruned, persistent=False)
        self.register_buffer("to_full", ids.clone(), persistent=False)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(loss, greedy agreement per response position, parts) for a padded batch."""
        ids, top_ids, top_probs, mask = (batch["ids"], batch["top_ids"], batch["top_probs"],
                                         batch["mask"])
        parts = {}
        if self.family == "feature":
            logq, response, top_ids = self._unrolled(batch, parts)
        else:
            logq = torch.log_softmax(self.draft(input_ids=ids).logits.float(), dim=-1)
            response = batch["response"]
            parts["kl_loss"] = self._cross_entropy(logq, top_ids, top_probs, mask)
        loss = parts["kl_loss"] + self.config.feature_loss_weight * parts.get(
            "feature_loss", torch.zeros((), device=logq.device))
        agree = (self.to_full[logq.argmax(-1)] == top_ids[..., 0].long()).float()
        return loss, _masked_mean(agree, response), parts

    def _cross_entropy(self, logq: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """Cross-entropy to the teacher's top-k over the draft's (pruned) vocabulary."""
        pruned = self.to_pruned[top_ids.long()]
        picked = logq.gather(-1, pruned.clamp_min(0))
        ce = -(top_probs.float() * picked * (pruned >= 0)).sum(-1)
        return _masked_mean(ce, mask)

    def _unrolled(self, batch: dict, parts: dict) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
        """The head over the sequence with the target's features, then `unroll - 1` more passes
        where each position reads the head's own prediction of its predecessor's feature (what
        deeper draft levels see).  Losses are averaged over the passes; returns the first pass's
        log-probabilities (level-0 agreement) with the response mask and teacher ids they align
        with."""
        ids, stored = batch["ids"], batch["hidden"]
        feats = stored[:, :, self.last_index].float()
        top_ids, top_probs, mask = batch["top_ids"][:, 1:], batch["top_probs"][:, 1:], \
            batch["mask"][:, 1:]
        inputs = self.draft.project(stored[:, :-1, self.input_index].flatten(-2).float())
        if self.training and self.config.feature_noise > 0:
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * self.config.feature_noise
        positions = torch.arange(1, ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        kl, feature, first = [], [], None
        for _ in range(max(self.config.unroll, 1)):
            out = self.draft(input_ids=ids[:, 1:], features=inputs, position_ids=positions)
            predicted = out.hidden_states[-1]
            logq = torch.log_softmax(out.logits.float(), dim=-1)
            first = logq if first is None else first
            kl.append(self._cross_entropy(logq, top_ids, top_probs, mask))
            error = F.smooth_l1_loss(predicted.float(), feats[:, 1:], reduction="none").mean(-1)
            feature.append(_masked_mean(error, mask))
            inputs = torch.cat([inputs[:, :1], predicted[:, :-1].float()], dim=1)
        parts["kl_loss"] = torch.stack(kl).mean()
        parts["feature_loss"] = torch.stack(feature).mean()
        return first, batch["response"][:, 1:], top_ids

    def training_step(self, batch: dict, _: int) -> torch.Tensor:
        loss, alpha, parts = self(batch)
        self.tokens_seen += batch["mask"].sum()
        self.text_tokens_seen += batch["mask"][batch["text"]].sum()
        self.log_dict({"train_loss": loss, "train_alpha": alpha,
                       "tokens_seen": self.tokens_seen.float(),
                       "text_tokens_seen": self.text_tokens_seen.float(),
                       **{f"train_{k}": v for k, v in parts.items()}},
                      batch_size=batch["ids"].shape[0])
        return loss

    def validation_step(self, batch: dict, _: int) -> None:
        loss, alpha, _ = self(batch)
        n = float(batch["response"].sum())
        self.log_dict({"val_loss": loss, "val_alpha": alpha}, batch_size=n)

    def configure_optimizers(self):
        params = [p for p in self.draft.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)


def lr_factor(config: DraftTrainConfig, step: int, progress: float) -> float:
    """The learning rate's multiple of `config.lr` at `step`: a linear warmup over
    `warmup_steps`, then constant, or a cosine from 1 to `final_lr` over the run's `progress`
    (0 to 1)."""
    warmup = min(1.0, (step + 1) / max(config.warmup_steps, 1))
    if config.schedule == "constant":
        return warmup
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return warmup * (config.final_lr + (1.0 - config.final_lr) * cosine)


class BudgetSchedule(pl.Callback):
    """Sets the learning rate before every step (`lr_factor`), the run's progress being the
    larger of its share of the step budget (`max_epochs`) and of the time budget
    (`max_minutes`, Lightning's checkpointed Timer): the decay ends where the run does,
    whichever budget ends it."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule,
                             batch: dict, batch_idx: int) -> None:
        config = module.config
        timer = next(c for c in trainer.callbacks if isinstance(c, pl.callbacks.Timer))
        progress = max(trainer.global_step / max(trainer.estimated_stepping_batches, 1),
                       timer.time_elapsed("train") / (60.0 * config.max_minutes))
        factor = lr_factor(config, trainer.global_step, progress)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = config.lr * factor


@torch.no_grad()
def greedy_agreement(module: DraftDistiller, sequences: list[Sequence],
                     batch_size: int) -> float | None:
    """Level-0 greedy agreement with the teacher over the response positions of `sequences`
    (None for none)."""
    module.eval()
    agreed = counted = 0.0
    for i in range(0, len(sequences), batch_size):
        batch = {k: v.to(module.device) for k, v in collate(sequences[i:i + batch_size]).items()}
        _, alpha, _ = module(batch)
        n = float(batch["response"].sum())
        agreed, counted = agreed + float(alpha) * n, counted + n
    return agreed / counted if counted else None


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def collate(sequences: list[Sequence]) -> dict:
    """Right-padded batch: ids, hidden [n, T, L, H], teacher top-k, loss mask, response mask,
    and which sequences are teacher-forced text [n]."""
    n, length = len(sequences), max(s.ids.shape[0] for s in sequences)
    k, layers = sequences[0].top_ids.shape[1], sequences[0].hidden.shape[1:]
    batch = {"ids": torch.zeros(n, length, dtype=torch.long),
             "hidden": torch.zeros(n, length, *layers, dtype=torch.bfloat16),
             "top_ids": torch.zeros(n, length, k, dtype=torch.int32),
             "top_probs": torch.zeros(n, length, k, dtype=torch.float16),
             "mask": torch.zeros(n, length, dtype=torch.bool),
             "response": torch.zeros(n, length, dtype=torch.bool),
             "text": torch.tensor([s.source != RESPONSE for s in sequences])}
    for i, s in enumerate(sequences):
        t = s.ids.shape[0]
        batch["ids"][i, :t] = s.ids
        batch["hidden"][i, :t] = s.hidden
        batch["top_ids"][i, :t] = s.top_ids
        batch["top_probs"][i, :t] = s.top_probs
        batch["mask"][i, : t - 1] = True  # every position with a next token is taught
        batch["response"][i, s.prompt_len - 1 : t - 1] = True  # positions predicting the reply
    return batch


class EpochBatches(Sampler[list[int]]):
    """Batches of a permutation drawn per epoch from (seed, epoch) alone, from the position
    (`epoch`, `trained` batches of it) on: a resumed run continues the epoch's order.  Given
    the sequences' `lengths`, each batch holds sequences of similar length (transformers'
    length-grouped order: shuffled, sorted within mega-batches of 50 batches at most), in a
    shuffled order of batches, so a batch pads little."""

    def __init__(self, size: int, batch_size: int, seed: int,
                 lengths: list[int] | None = None) -> None:
        self.size, self.batch_size, self.seed, self.lengths = size, batch_size, seed, lengths
        self.epoch, self.trained = 0, 0

    def advance(self, trained: int) -> None:
        """`trained` batches of the epoch are done; after its last one the next epoch starts."""
        self.epoch, self.trained = ((self.epoch + 1, 0) if trained == len(self)
                                    else (self.epoch, trained))

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        if self.lengths is None:
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = get_length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        batches = [order[i:i + self.batch_size] for i in range(0, self.size, self.batch_size)]
        if self.lengths is not None:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return iter(batches[self.trained:])

    def __len__(self) -> int:
        return math.ceil(self.size / self.batch_size)


class ResumableLoader(DataLoader):
    """A DataLoader over `EpochBatches` whose position Lightning keeps in its checkpoints (it
    has `state_dict`/`load_state_dict`), so a mid-epoch resume continues the epoch's order."""

    batch_sampler: EpochBatches

    def state_dict(self) -> dict:
        return {"epoch": self.batch_sampler.epoch, "trained": self.batch_sampler.trained}

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.epoch, self.batch_sampler.trained = state["epoch"], state["trained"]


class ExactResume(pl.Callback):
    """Counts the batches trained on in the epoch (the loader's position; Lightning prefetches,
    so the loader cannot count them itself) and keeps the global RNG states (python, numpy,
    torch, CUDA: e.g. the feature noise) in every checkpoint."""

    def __init__(self, batches: EpochBatches) -> None:
        self.batches = batches

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                           outputs: object, batch: dict, batch_idx: int) -> None:
        self.batches.advance(batch_idx + 1)

    def state_dict(self) -> dict:
        legacy = np.random.get_state()
        return {"python": random.getstate(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "numpy": (legacy[0], torch.from_numpy(legacy[1].astype(np.int64)), *legacy[2:])}

    def load_state_dict(self, state: dict) -> None:
        version, values, gauss = state["python"]
        random.setstate((version, tuple(values), gauss))
        torch.set_rng_state(state["torch"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        name, key, *rest = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), *rest))


class LearningCurve(pl.Callback):
    """Appends (step, training seconds, sequences seen, tokens seen, of them in teacher-forced
    text, val loss, val alpha) at each validation to a CSV; training seconds survive a resume
    (Lightning's Timer is checkpointed), tokens seen too (buffers of the module)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if (trainer.sanity_checking or trainer.state.fn != "fit"
                or "val_alpha" not in trainer.callback_metrics):
            return
        timer = next(c for c in trainer.callbacks if isinstance(c, pl.callbacks.Timer))
        metrics = trainer.callback_metrics
        new = not self.path.is_file()
        with self.path.open("a") as f:
            if new:
                f.write("step,train_seconds,sequences_seen,tokens_seen,text_tokens_seen,"
                        "val_loss,val_alpha\n")
            f.write(f"{trainer.global_step},{timer.time_elapsed('train'):.1f},"
                    f"{trainer.global_step * module.config.batch_size},{int(module.tokens_seen)},"
                    f"{int(module.text_tokens_seen)},"
                    f"{float(metrics['val_loss']):.5f},{float(metrics['val_alpha']):.5f}\n")


def read_curve(path: Path) -> list[dict]:
    """The learning curve, one row per step (a resumed run's repeated steps counted once)."""
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text().splitlines()
    names = lines[0].split(",")
    rows = {}
    for line in lines[1:]:
        row = dict(zip(names, map(float, line.split(","))))
        rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def fit(module: DraftDistiller, train: list[Sequence], val: list[Sequence], folder: Path,
        logger: pl.loggers.Logger | None) -> dict:
    """Train with checkpoint/resume under `folder`; return the final validation metrics.  On
    SIGTERM Lightning stops after the current batch; the process then exits with status 143
    (130 on Ctrl-C) and a re-run resumes from the last checkpoint."""
    config = module.config
    pl.seed_everything(config.seed, verbose=False)
    ckpt_dir = Path(folder) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    lengths = [s.ids.shape[0] for s in train] if config.group_by_length else None
    batches = EpochBatches(len(train), config.batch_size, config.seed, lengths)
    loader = ResumableLoader(train, batch_sampler=batches, collate_fn=collate,
                             generator=torch.Generator())  # iter() leaves the global RNG alone
    val_loader = DataLoader(val, batch_size=config.batch_size, collate_fn=collate)
    steps_per_epoch = len(loader)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="best", save_top_k=1,
                                              monitor="val_alpha", mode="max",
                                              save_on_train_epoch_end=False)
    # every validation, improved or not: `latest.ckpt` and its copy `last.ckpt` (the resume point)
    latest = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="latest", save_last=True,
                                          save_top_k=1, save_on_train_epoch_end=False)
    trainer = pl.Trainer(
        max_epochs=config.max_epochs, max_time={"minutes": config.max_minutes},
        accelerator="auto", devices=1,
        precision=resolve_precision(config.precision, resolve_device("auto")),
        logger=logger or False,
        callbacks=[checkpoint, latest,
                   pl.callbacks.EarlyStopping("val_alpha", mode="max", patience=config.patience),
                   LearningCurve(Path(folder) / "curve.csv"), ExactResume(batches),
                   BudgetSchedule()]
        + ([pl.callbacks.LearningRateMonitor("step")] if logger else []),
        val_check_interval=min(config.val_every_steps, steps_per_epoch),
        check_val_every_n_epoch=None if config.val_every_steps < steps_per_epoch else 1,
        log_every_n_steps=5, enable_model_summary=False, gradient_clip_val=1.0,
        default_root_dir=str(folder))
    last = ckpt_dir / "last.ckpt"
    try:
        trainer.fit(module, loader, val_loader, ckpt_path=str(last) if last.is_file() else None)
        best = checkpoint.best_model_path
        if best:
            module.load_state_dict(torch.load(best, weights_only=False)["state_dict"])
        metrics = trainer.validate(module, val_loader, verbose=False)[0]
    except SIGTERMException:  # Lightning stops the run with exit status 0: not a success
        raise SystemExit(128 + signal.SIGTERM) from None
    except SystemExit:
        if trainer.interrupted:  # Lightning turns Ctrl-C into exit(1): the CLI's exit 130
            raise KeyboardInterrupt from None
        raise
    return {k: float(v) for k, v in metrics.items()}
