"""Rich renderings of benchmark results (the product's own tables are in kvfold/report.py)."""

from __future__ import annotations

from rich.table import Table

__all__ = ["frontier_table"]


def frontier_table(report: dict) -> Table:
    """Compression reached at the target per method and model (kvfold-bench frontier)."""
    target = report["target_top1_ratio"]
    table = Table(title=f"KV bytes saved at top-1 ratio {target:g} / and also perplexity ratio ≤ {1 / target:.4f} "
                  f"({report['eval_text']}, {report['date']})")
    table.add_column("method")
    for m in report["models"]:
        table.add_column(f"{m['model']} ({m['num_kv_heads']} KV heads)", justify="right")
    names = list(dict.fromkeys(r["name"] for m in report["models"] for r in m["methods"]))
    for name in names:
        cells = []
        for m in report["models"]:
            row = next((r for r in m["methods"] if r["name"] == name), None)
            if row is None:
                cells.append("-")
                continue
            at, joint = row["compression_at_target"], row.get("compression_at_joint_target")
            cell = "not reached" if at is None else f"{at:.1%}" + (
                " (or more)" if row["every_point_passes"] and row["origin"] is None and len(row["points"]) > 1 else "")
            cells.append(f"{cell} / {'not reached' if joint is None else f'{joint:.1%}'}")
        table.add_row(name, *cells)
    return table
