"""Rich renderings of API results (tables; progress bars: kvfold/progress.py). Kept apart so the API returns plain
data. The product's commands only (calibrate, inspect, export, verify); the benchmarks' tables are in the kvfold-bench
package (bench/kvfold_bench/tables.py)."""

from __future__ import annotations

from rich.table import Table

from kvfold.calib.artifact import CalibHeader
from kvfold.calib.inspect import MASSES, LayerSpectrum
from kvfold.plan.bit_plan import KEY_MIN_BITS

__all__ = ["calib_summary", "export_summary", "spectrum_table", "verify_table"]

_KIND_NAMES = {"q": "Q (post-RoPE)", "k": "K (post-RoPE)", "v": "V", "o": "attn out"}


def calib_summary(result) -> str:
    h = result.header
    m = h.model
    return (f"calibrated {m.spec} ({m.architecture}, {m.num_layers} layers, {m.num_heads}/{m.num_kv_heads} "
            f"heads, head_dim {m.head_dim}) on {h.tokens} {h.options.source} tokens in "
            f"{result.seconds_collect:.1f} s -> {result.output}")


def export_summary(result) -> str:
    m, c = result.manifest, result.manifest.chosen
    return (f"exported {m.source.spec} ({m.method}) -> {result.output}: KV cache {1 - c.compression:.1%} of the "
            f"original (p = {c.compression:.3f}){_windowed(m)}; on {m.eval_text} ({m.eval_tokens} tokens): top-1 ratio "
            f"{c.top1_ratio:.4f} ± {c.top1_se:.4f}, perplexity ratio {c.ppl_ratio:.4f} ± {c.ppl_se:.4f}, top-1 "
            f"agreement {c.agreement:.4f}, mean KL {c.kl:.5f} nats (p99 {c.kl_p99:.4f}); target: {m.target}; "
            f"{len(m.curve)} points on the curve")


def _windowed(m) -> str:
    """A windowed export's whole tokens, and its bytes at 32K beside the 4,096 tokens `p` is stated at."""
    if not (m.sinks or m.window):
        return ""
    at_32k = m.kv_fraction(32768)
    return (f" at 4,096 tokens with the first {m.sinks} and last {m.window} kept whole ({at_32k:.1%} at 32K), keys at "
            f"{m.key_bits or KEY_MIN_BITS} bits or more")


def spectrum_table(header: CalibHeader, rows: list[LayerSpectrum]) -> Table:
    levels = "/".join(f"{m:.1%}".replace(".0%", "%") for m in MASSES)
    table = Table(title=f"Dims (of {header.model.head_dim}) holding {levels} of the singular-value mass, "
                  f"mean over heads — {header.model.spec}, {header.tokens} {header.options.source} tokens")
    table.add_column("layer", justify="right")
    for kind in _KIND_NAMES.values():
        table.add_column(kind, justify="center")
    for row in rows:
        table.add_row(str(row.layer), *("/".join(f"{d:.0f}" for d in row.dims[k]) for k in _KIND_NAMES))
    means = {k: [sum(r.dims[k][i] for r in rows) / len(rows) for i in range(len(MASSES))] for k in _KIND_NAMES}
    table.add_section()
    table.add_row("mean", *("/".join(f"{d:.1f}" for d in means[k]) for k in _KIND_NAMES))
    return table


def verify_table(report) -> Table:
    """Checks, then the figures, then the two generations side by side."""
    table = Table(title=f"kvfold verify {report.export}", show_lines=False)
    table.add_column("check")
    table.add_column("", justify="center")
    table.add_column("detail")
    for c in report.checks:
        table.add_row(c.name, "[green]ok[/green]" if c.ok else "[red]FAILED[/red]", c.detail)
    for t in report.texts:
        table.add_section()
        table.add_row(t["eval_text"], "", f"top-1 ratio {t['top1_ratio']:.4f} ± {t['top1_se']:.4f}, perplexity ratio "
                      f"{t['ppl_ratio']:.4f} ± {t['ppl_se']:.4f}, top-1 agreement {t['agreement']:.4f}, mean KL "
                      f"{t['kl']:.5f} nats (p99 {t['kl_p99']:.4f}); {t['tokens']} tokens")
    g = report.generation
    if g:
        table.add_section()
        run = g["runs"][0]
        table.add_row("prompt", "", run["prompt"])
        table.add_row("original", "", run["original"])
        table.add_row("exported", "", run["exported"])
        first = ", ".join("none" if r["first_divergence"] is None else str(r["first_divergence"]) for r in g["runs"])
        table.add_row("generation", "", f"first differing token of {len(g['runs'])} greedy continuations: {first} "
                      f"(of {run['new_tokens']}); reading the original's continuations the export's next token is "
                      f"the original's on {g['forced_agreement']:.4f} of {g['forced_tokens']}")
    table.caption = "all checks passed" if report.ok else f"FAILED: {', '.join(c.name for c in report.failed())}"
    return table
