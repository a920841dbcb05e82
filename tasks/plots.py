"""Matplotlib figures of a run's curves (for the Flyte deck and MLflow)."""

from __future__ import annotations

import base64
import io
from typing import Any

CURVES = ("train/reward", "validation/accuracy", "train/kl_penalty", "train/loss")


def curves(history: dict[str, list[tuple[int, float]]]) -> Any:
    """A 2x2 figure: reward, validation accuracy, KL and loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for ax, key in zip(axes.flat, CURVES):
        points = sorted(history.get(key, []))
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def to_html(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"/>'
