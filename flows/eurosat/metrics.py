"""Classification metrics and the PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def compute_metrics(y_true, y_pred, class_names: list[str]) -> dict:
    """Accuracy, per-class precision/recall/F1/support, macro and weighted F1, confusion matrix (rows: true)."""
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    labels = list(range(len(class_names)))
    precision, recall, f1, support = precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    per_class = [
        {
            "class": name,
            "precision": round(float(p), 4),
            "recall": round(float(r), 4),
            "f1": round(float(f), 4),
            "support": int(s),
        }
        for name, p, r, f, s in zip(class_names, precision, recall, f1, support)
    ]
    _, _, macro_f1, _ = precision_recall_fscore_support(y_true, y_pred, labels=labels, average="macro", zero_division=0)
    _, _, weighted_f1, _ = precision_recall_fscore_support(
        y_true, y_pred, labels=labels, average="weighted", zero_division=0
    )
    return {
        "accuracy": round(float(accuracy_score(y_true, y_pred)), 4),
        "macro_f1": round(float(macro_f1), 4),
        "weighted_f1": round(float(weighted_f1), 4),
        "num_test": int(len(y_true)),
        "per_class": per_class,
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=labels).tolist(),
        "class_names": list(class_names),
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_confusion_matrix(matrix, class_names: list[str], path: str | Path) -> None:
    plt = _pyplot()
    m = np.asarray(matrix)
    fig, ax = plt.subplots(figsize=(8, 7))
    norm = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(class_names)), class_names, rotation=45, ha="right")
    ax.set_yticks(range(len(class_names)), class_names)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            ax.text(
                j, i, str(m[i, j]), ha="center", va="center", fontsize=8, color="white" if norm[i, j] > 0.5 else "black"
            )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"Confusion matrix (test, n={int(m.sum())}, accuracy {np.trace(m) / max(m.sum(), 1):.3f})")
    fig.colorbar(im, ax=ax, fraction=0.046, label="fraction of the true class")
    fig.tight_layout()
    _save(fig, path)


def plot_learning_curves(history: dict, path: str | Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    epochs = range(1, len(history.get("loss", [])) + 1)
    for ax, key, title in ((axes[0], "loss", "loss"), (axes[1], "accuracy", "accuracy")):
        if history.get(key):
            ax.plot(epochs, history[key], label="train", marker="o")
        if history.get(f"val_{key}"):
            ax.plot(epochs, history[f"val_{key}"], label="validation", marker="o")
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.legend()
        ax.grid(alpha=0.3)
    lr = history.get("lr") or history.get("learning_rate")
    if lr:
        axes[2].plot(epochs, lr, marker="o")
        axes[2].set_yscale("log")
    axes[2].set_title("learning rate")
    axes[2].set_xlabel("epoch")
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path) -> None:
    import os

    plt = _pyplot()
    path = Path(path)
    tmp = path.with_name(f".kp-tmp.{path.name}")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
