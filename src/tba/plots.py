"""Plots of a run's ``metrics.jsonl``, written to ``<run>/plots/``."""

from __future__ import annotations

from pathlib import Path

from tba.metrics import read_metrics


def panels(eval_key: str) -> list[tuple[str, str]]:
    return [
        ("train/reward_mean", "reward (train batch)"),
        (eval_key, f"eval {eval_key.split('/', 1)[1]} (greedy)"),
        ("train/loss", "TB loss"),
        ("train/kl", "KL to reference (per sequence)"),
    ]


def plot_run(run_dir: Path, eval_key: str = "eval/accuracy") -> Path | None:
    """Write ``plots/training.png``; returns its path, or None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels(eval_key), strict=True):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "plots" / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
