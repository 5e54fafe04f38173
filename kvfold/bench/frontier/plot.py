"""The frontier picture: top-1 ratio vs KV bytes per token (fraction of fp16), one curve per method and
one panel per model, the target line marked. matplotlib (the `bench` extra) is imported only here."""

from __future__ import annotations

from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["draw", "pyplot"]

# kvfold's own curves solid and bold, ablations dashed, peers in their own colours
_STYLE = {"kvfold": dict(color="C3", lw=2.6, marker="o"), "kvfold+fp8": dict(color="C1", lw=2.6, marker="o")}


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
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 6.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for i, m in enumerate(model["methods"]):
            pts = sorted(m["points"], key=lambda p: -p["kv_fraction"])
            xs, ys = [p["kv_fraction"] for p in pts], [p["top1_ratio"] for p in pts]
            if m["origin"] is None and len(pts) > 1:  # every compressing sweep starts at the original
                xs, ys = [1.0, *xs], [1.0, *ys]
            style = _STYLE.get(m["name"], dict(color=f"C{(i + 4) % 10}", lw=1.4, marker="s",
                                               ls="--" if m["name"].startswith("kvfold-") else "-"))
            at = m["compression_at_target"]
            label = f"{m['label']}: {at:.1%} saved at {target:g}" if at is not None else f"{m['label']}: not reached"
            ax.plot(xs, ys, label=label, ms=4, **style)
        ax.axhline(target, color="k", lw=1, ls=":")
        ax.text(0.995, target, f" {target:g} of the original", va="bottom", ha="right", fontsize=8,
                transform=ax.get_yaxis_transform())
        ax.set_xlim(1.02, 0.3)  # more compression to the right
        ax.set_ylim(max(0.8, min(0.95, target - 0.08)), 1.005)
        ax.set_xlabel("KV-cache bytes per token (fraction of fp16)")
        ax.set_ylabel(f"next-token top-1 ratio ({model['eval_tokens']} held-out tokens)")
        ax.set_title(f"{model['model']} ({model['num_heads']} query / {model['num_kv_heads']} KV heads)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="lower left")
    fig.suptitle(f"kvfold bench frontier, {report['date']} ({report['eval_text']}, ranks rounded to "
                 f"multiples of {report['rank_multiple']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
