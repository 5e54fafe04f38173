"""`kvfold-bench serve` shown: a table on stderr and the PNG (matplotlib, the `bench` extra, imported only
when drawing): KV token capacity and tokens/s per configuration, two bar panels."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

__all__ = ["draw", "serve_table"]


def _fmt(value, spec: str = ",") -> str:
    return "-" if value is None else format(value, spec)


def _speed_ratio(c: dict, key: str):
    """A configuration's tokens/s over the original's: the median over the rounds where there were several."""
    rounds = (c.get("rounds") or {}).get("vs_original") or {}
    return rounds.get(f"{key}_median", (c.get("vs_original") or {}).get(key))


def serve_table(report: dict) -> Table:
    """One row per configuration: whether it runs, vLLM's capacity, bytes per token, the ratio to the
    original's capacity, and, where measured, peak running requests and preemptions, the tokens/s of each
    workload and their ratios to the original's (with --rounds, the median of each round's), the paired
    decode's ratio (the engines taking turns in one process), the probe's figures (columns no configuration has
    are left out: --workload none shows capacity only)."""
    def row(c: dict) -> dict:
        limited, long, probe = c.get("cache_limited") or {}, c.get("long_context") or {}, c.get("probe") or {}
        ppl = probe.get("ppl_ratio")
        return {"runs": "yes" if c["runs"] else "[red]no[/red]", "KV tokens": _fmt(c.get("kv_token_capacity")),
                "B/token": _fmt(c.get("bytes_per_token"), ",.0f"),
                "× orig.": _fmt((c.get("vs_original") or {}).get("kv_token_capacity"), ".3f"),
                "peak run": _fmt(limited.get("peak_running_requests")),
                "preempted": _fmt(limited.get("preemptions")),
                "gen tok/s": _fmt(limited.get("generated_tokens_per_s"), ",.1f"),
                "gen ×": _fmt(_speed_ratio(c, "generated_tokens_per_s"), ".3f"),
                "decode tok/s": _fmt(long.get("decode_tokens_per_s"), ",.1f"),
                "decode ×": _fmt(_speed_ratio(c, "decode_tokens_per_s"), ".3f"),  # with --rounds, the median
                "paired ×": _fmt((c.get("paired_decode") or {}).get("vs_original"), ".3f"),
                "probe top-1": _fmt(probe.get("top1_agreement"), ".3f"),
                "ppl ×": _fmt(ppl, ",.0f" if ppl is not None and ppl >= 100 else ".3f")}

    several = report.get("rounds", 1) > 1
    rows = {name: row(c) for name, c in report["configurations"].items()}
    columns = [k for k in next(iter(rows.values())) if k in ("runs", "KV tokens", "× orig.")
               or any(r[k] != "-" for r in rows.values())]
    rounds = f"; tok/s: the first of {report['rounds']} rounds, ×: the median of the rounds' ratios" if several else ""
    table = Table(title=f"vLLM, {report['kv_cache_mib']} MiB of KV cache each, {report['dtype']}; probe: "
                  f"teacher-forced top-1 agreement and perplexity ratio against kv_cache_dtype=auto{rounds}")
    table.add_column("configuration", no_wrap=True)
    for name in columns:  # numbers whole even in a narrow console (a log, a pipe: 80 columns)
        widest = max(Text.from_markup(r[name]).cell_len for r in rows.values())
        table.add_column(name, justify="right", min_width=widest)
    for name, r in rows.items():
        table.add_row(name, *(r[k] for k in columns))
    return table


def draw(report: dict, path: Path) -> None:
    """Top: KV token capacity per configuration (× the original's on each bar; a configuration that does
    not run on this build hatched, its capacity only what vLLM allocated). Bottom: generated tokens/s of the
    cache-limited workload, decode tokens/s of the long-context one, and that decode paired (the engines taking
    turns in one process), where measured."""
    from kvfold_bench.frontier.plot import pyplot

    plt = pyplot()
    configs = report["configurations"]
    names = list(configs)
    xs = range(len(names))
    fig, (cap, speed) = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(names) + 3), 10))
    for x, name in zip(xs, names, strict=True):
        c = configs[name]
        color = {"original": "#7f7f7f", "export": "#d62728"}.get(c["kind"], "#1f77b4")
        capacity = c.get("kv_token_capacity") or 0
        cap.bar(x, capacity, color=color if c["runs"] else "white", edgecolor=color, hatch=None if c["runs"] else "//")
        ratio = c.get("vs_original", {}).get("kv_token_capacity")
        label = "" if ratio is None else f"{ratio:.2f}×"
        cap.annotate(label if c["runs"] else f"{label}\ndoes not run", (x, capacity), ha="center", va="bottom",
                     fontsize=8)
    series = [("cache_limited", "generated_tokens_per_s", "generated tok/s, cache-limited workload"),
              ("long_context", "decode_tokens_per_s", "decode tok/s, batch 1 at long context"),
              ("paired_decode", "decode_tokens_per_s", "decode tok/s, batch 1 at long context, paired: the engines "
                                                       "taking turns in one process (no engine-core process)")]
    series = [s for s in series if any((configs[n].get(s[0]) or {}).get(s[1]) is not None for n in names)]
    width = 0.8 / max(1, len(series))
    for i, (workload, key, label) in enumerate(series):
        shift = (i - (len(series) - 1) / 2) * width
        ys = [(configs[n].get(workload) or {}).get(key) for n in names]
        speed.bar([x + shift for x in xs], [y or 0 for y in ys], width, label=label)
        for x, name, y in zip(xs, names, ys, strict=True):  # × the original's (the rounds' median; paired: its own)
            c = configs[name]
            paired = (c.get("paired_decode") or {}).get("vs_original")
            ratio = paired if workload == "paired_decode" else _speed_ratio(c, key)
            if y is not None and ratio is not None:
                speed.annotate(f"{ratio:.2f}×", (x + shift, y), ha="center", va="bottom", fontsize=8)
    for x, name in zip(xs, names, strict=True):
        if not configs[name]["runs"]:
            speed.annotate("does not run", (x, 0), xytext=(0, 4), textcoords="offset points", ha="center",
                           va="bottom", fontsize=8, rotation=90)
    w = report["workloads"]
    shapes = [f"{s.get('requests', 1)} × ({s['prompt_tokens']} + {s['new_tokens']})"
              for s in (w.get("cache_limited"), w.get("long_context")) if s is not None]
    cap.set_title(f"KV token capacity in {report['kv_cache_mib']} MiB (vLLM's blocks × block size)")
    several = report.get("rounds", 1) > 1
    rounds = f" (first of {report['rounds']} rounds; × the original: the rounds' median)" if several else ""
    none = "tokens/s: no workload run (--workload none)"
    speed.set_title(f"tokens/s: {'; '.join(shapes)}{rounds}" if shapes else none)
    for ax in (cap, speed):
        ax.set_xticks(list(xs), names, fontsize=8, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    if speed.get_legend_handles_labels()[0]:
        speed.legend(fontsize=8)
    fig.suptitle(f"kvfold-bench serve: vLLM, {report['dtype']}, the same KV budget for every configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
