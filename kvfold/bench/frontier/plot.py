"""The frontier picture: top-1 ratio vs KV bytes per token (fraction of fp16), one curve per method and
one panel per model, the target line marked. matplotlib (the `bench` extra) is imported only here."""

from __future__ import annotations

import textwrap
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["draw", "pyplot"]

# kvfold's own curves bold, its ablations dashed, every method its own colour (the same in each panel)
_BOLD = {"kvfold", "kvfold+fp8"}
_COLORS = ["#d62728", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#2ca02c", "#9467bd",
           "#000000", "#ff7f0e", "#aec7e8", "#98df8a"]


def pyplot():
    """matplotlib.pyplot drawing to files only (no display here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVFoldError("--png needs matplotlib: pip install -e '.[bench]' (scripts/setup.sh does)") from None
    return plt


def draw(report: dict, path: Path) -> None:
    plt = pyplot()
    models = report["models"]
    target = report["target_top1_ratio"]
    names = list(dict.fromkeys(r["name"] for m in models for r in m["methods"]))
    color = {n: _COLORS[i % len(_COLORS)] for i, n in enumerate(names)}
    lowest = min(p["kv_fraction"] for m in models for r in m["methods"] for p in r["points"])
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 7.0), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for m in model["methods"]:
            pts = sorted(m["points"], key=lambda p: -p["kv_fraction"])
            xs, ys = [p["kv_fraction"] for p in pts], [p["top1_ratio"] for p in pts]
            if m["origin"] is None and len(pts) > 1:  # every compressing sweep starts at the original
                xs, ys = [1.0, *xs], [1.0, *ys]
            bold = m["name"] in _BOLD
            style = dict(color=color[m["name"]], lw=2.6 if bold else 1.4, marker="o" if bold else "s",
                         ls="--" if m["name"].startswith("kvfold-") else "-")
            at = m["compression_at_target"]
            label = f"{m['label']}: {at:.1%} saved at {target:g}" if at is not None else f"{m['label']}: not reached"
            ax.plot(xs, ys, label=label, ms=4, **style)
        ax.axhline(target, color="k", lw=1, ls=":")
        ax.text(0.995, target, f" {target:g} of the original", va="bottom", ha="right", fontsize=8,
                transform=ax.get_yaxis_transform())
        ax.set_xlim(1.02, min(0.4, lowest - 0.03))  # more compression to the right
        ax.set_ylim(max(0.8, min(0.95, target - 0.08)), 1.005)
        ax.set_xlabel("KV-cache bytes per token (fraction of fp16)")
        ax.set_ylabel(f"next-token top-1 ratio ({model['eval_tokens']} held-out tokens)")
        ax.set_title(f"{model['model']} ({model['num_heads']} query / {model['num_kv_heads']} KV heads)")
        notes = "\n".join(textwrap.fill(n, 110) for n in model.get("notes", []))
        ax.text(0.0, -0.13, notes, transform=ax.transAxes, ha="left", va="top", fontsize=7.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="lower left")
    fig.suptitle(f"kvfold bench frontier, {report['date']} ({report['eval_text']}, ranks rounded to "
                 f"multiples of {report['rank_multiple']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
