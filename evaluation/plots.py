"""Figures (MLflow artifacts) and the CSV plot data DVC compares across revisions."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from specstop.common.files import write_atomic  # noqa: E402


def write_csv(path: Path, header: list[str], rows: list[tuple]) -> None:
    """A small CSV file, written atomically."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    write_atomic(path, lambda tmp: tmp.write_text(buffer.getvalue()))


def roc_figure(curves: dict[str, list[tuple[float, float]]]) -> Figure:
    fig, ax = plt.subplots(figsize=(5, 5))
    for name, points in curves.items():
        if points:
            ax.plot(*zip(*points), label=name)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (val)")
    ax.legend()
    return fig


def calibration_figure(tables: dict[str, list[tuple[float, float, int]]]) -> Figure:
    fig, ax = plt.subplots(figsize=(5, 5))
    top = 0.0
    for name, table in tables.items():
        predicted, observed = [t[0] for t in table], [t[1] for t in table]
        ax.plot(predicted, observed, marker="o", label=name)
        top = max(top, *predicted, *observed)
    ax.plot([0, top], [0, top], color="grey", linestyle=":")
    ax.set(xlabel="mean predicted acceptance", ylabel="observed acceptance",
           title="Calibration (val, equal-count bins)")
    ax.legend()
    return fig


def speedup_figure(curves: dict[str, list[tuple[float, float]]], static: float,
                   oracle: float) -> Figure:
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (name, points) in zip(axes[0], curves.items()):
        finite = [(t, s) for t, s in points if abs(t) != float("inf")]
        if finite:
            ax.plot(*zip(*finite), marker=".")
        ax.axhline(static, color="grey", linestyle="--", label="best fixed γ")
        ax.axhline(oracle, color="black", linestyle=":", label="oracle")
        ax.set(xlabel="threshold" if "cost" not in name else "ρ", ylabel="speedup vs ar",
               title=name)
        ax.legend()
    fig.tight_layout()
    return fig


def importance_figure(importance: dict[str, float]) -> Figure:
    names = sorted(importance, key=importance.get)
    fig, ax = plt.subplots(figsize=(6, 0.25 * len(names) + 1))
    ax.barh(names, [importance[n] for n in names])
    ax.set(xlabel="AUC drop when the feature is shuffled (val)", title="Feature importance")
    fig.tight_layout()
    return fig
