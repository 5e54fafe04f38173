"""The frontier picture: top-1 ratio vs KV bytes per token (fraction of fp16), one curve per method and
one panel per model, the target line marked. matplotlib (the `bench` extra) is imported only here."""

from __future__ import annotations

import textwrap
from pathlib import Path

from kvfold.errors import KVFoldError

__all__ = ["draw", "pyplot"]

# kvfold's own curves bold, its ablations dashed, every method its own colour (the same in each panel)
_BOLD = {"kvfold", "kvfold+fp8", "kvfold-bits"}
_ABLATIONS = ("kvfold-shared-r", "kvfold-split-r", "kvfold-random", "kvfold-zdc")
_COLORS = ["#d62728", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4", "#2ca02c", "#9467bd",
           "#000000", "#ff7f0e", "#aec7e8", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#dbdb8d"]


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
    """Top row: top-1 ratio (the target line at A); bottom row: perplexity ratio ppl/ppl₀ (the joint
    target's line at 1/A), legends with the compression each method keeps at the target / the joint one."""
    plt = pyplot()
    models = report["models"]
    target = report["target_top1_ratio"]
    names = list(dict.fromkeys(r["name"] for m in models for r in m["methods"]))
    color = {n: _COLORS[i % len(_COLORS)] for i, n in enumerate(names)}
    lowest = min(p["kv_fraction"] for m in models for r in m["methods"] for p in r["points"])
    fig, axes = plt.subplots(2, len(models), figsize=(7.5 * len(models), 12.5), squeeze=False)
    for col, model in enumerate(models):
        top, ppl = axes[0][col], axes[1][col]
        for m in model["methods"]:
            pts = sorted(m["points"], key=lambda p: -p["kv_fraction"])
            xs = [p["kv_fraction"] for p in pts]
            ys, zs = [p["top1_ratio"] for p in pts], [p["ppl_ratio"] for p in pts]
            if m["origin"] is None and len(pts) > 1:  # every compressing sweep starts at the original
                xs, ys, zs = [1.0, *xs], [1.0, *ys], [1.0, *zs]
            bold = m["name"] in _BOLD
            style = dict(color=color[m["name"]], lw=2.6 if bold else 1.4, marker="o" if bold else "s",
                         ls="--" if m["name"] in _ABLATIONS else "-", ms=4)
            at, joint = m["compression_at_target"], m.get("compression_at_joint_target")
            top.plot(xs, ys, label=f"{m['label']}: " + (f"{at:.1%} saved" if at is not None else "not reached"),
                     **style)
            ppl.plot(xs, zs, label=f"{m['label']}: " + (f"{joint:.1%} saved" if joint is not None else "not reached")
                     + _with_keys(m), **style)
            kept = m.get("kv_fraction_at_joint_target_with_passkeys")
            if kept is not None:  # the point read with the pass keys (--passkey): ringed
                z = next(p["ppl_ratio"] for p in pts if p["kv_fraction"] == kept)
                ppl.plot([kept], [z], marker="o", ms=11, mfc="none", mec=style["color"], ls="none")
        _line(top, target, f" top-1 ratio {target:g}", "bottom")
        _line(ppl, 1 / target, f" perplexity ratio {1 / target:.4f}", "top")
        for ax in (top, ppl):
            ax.set_xlim(1.02, min(0.4, lowest - 0.03))  # more compression to the right
            ax.set_xlabel("KV-cache bytes per token (fraction of fp16)")
            ax.grid(alpha=0.3)
        top.set_ylim(max(0.8, min(0.95, target - 0.08)), 1.005)
        ppl.set_ylim(0.995, 1 + 3 * (1 / target - 1) + 0.02)
        top.set_ylabel(f"next-token top-1 ratio ({model['eval_tokens']} held-out tokens)")
        ppl.set_ylabel("perplexity ratio ppl / ppl₀ (lower is better)")
        top.set_title(f"{model['model']} ({model['num_heads']} query / {model['num_kv_heads']} KV heads): "
                      f"saved at top-1 ≥ {target:g}", fontsize=10)
        ppl.set_title(f"saved at the joint target: top-1 ≥ {target:g} and perplexity ratio ≤ {1 / target:.4f}",
                      fontsize=10)
        top.legend(fontsize=7.5, loc="lower left")
        ppl.legend(fontsize=7.5, loc="upper left")
        notes = "\n".join(textwrap.fill(n, 110) for n in model.get("notes", []))
        ppl.text(0.0, -0.13, notes, transform=ppl.transAxes, ha="left", va="top", fontsize=7.5)
    fig.suptitle(f"kvfold-bench frontier, {report['date']} ({report['eval_text']}, ranks rounded to "
                 f"multiples of {report['rank_multiple']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _with_keys(m: dict) -> str:
    """With --passkey: what the method keeps once its 4K pass keys must survive export's check too."""
    if "passkey_checks" not in m or not m["passkey_checks"]:
        return ""
    kept = m["kv_fraction_at_joint_target_with_passkeys"]
    return f"; with pass keys {1 - kept:.1%}" if kept is not None else "; pass keys lost"


def _line(ax, y: float, text: str, va: str) -> None:
    ax.axhline(y, color="k", lw=1, ls=":")
    ax.text(0.995, y, text, va=va, ha="right", fontsize=8, transform=ax.get_yaxis_transform())
