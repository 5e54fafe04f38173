"""`kvfold-bench frontier`: every method swept on each model, one JSON (and PNG) with every point."""

from __future__ import annotations

import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

import kvfold
from kvfold.adapters import HeadLayout
from kvfold.sources.embedded import MHA_OF

from .methods import DEFAULT, PEERS, get_methods
from .setup import Setup
from .sweep import sweep_model

__all__ = ["run_frontier"]


def _ordered(names: list[str]) -> list[str]:
    """Each method after the one its sweep starts from (kvfold+fp8 after fp8), adding it if missing."""
    out: list[str] = []  # the names as given (a narrowed grid, NAME@…, kept)
    for spec, m in zip(names, get_methods(names), strict=True):
        taken = [o.partition("@")[0] for o in out]
        if m.origin and m.origin not in taken:
            out.append(m.origin)
        if m.name not in taken:
            out.append(spec)
    return out


def run_frontier(models: list[str], methods: list[str] | None, target: float, eval_text: str, eval_tokens: int,
                 calib_tokens: int, sensitivity_tokens: int, multiple: int, context: int = 512,
                 passkey: int = 0, calib_text: str = "wiki:calib", score_from: int = 1) -> dict:
    """Without `methods`: every method on the first model, the peers (no ablations) on the others."""
    t0 = time.perf_counter()
    results = []
    for i, spec in enumerate(models):
        names = _ordered(list(methods or (DEFAULT if i == 0 else PEERS)))
        with tempfile.TemporaryDirectory(prefix="kvfold-frontier-") as tmp:
            setup = Setup(spec, Path(tmp), eval_text=eval_text, eval_tokens=eval_tokens, calib_tokens=calib_tokens,
                          calib_text=calib_text, sensitivity_tokens=sensitivity_tokens, multiple=multiple,
                          context=context, passkey=passkey, score_from=score_from)
            layout = HeadLayout.from_config(setup.model.config)
            rows = sweep_model(setup, get_methods(names), target)
        results.append({
            "model": spec, "num_heads": layout.num_heads, "num_kv_heads": layout.num_kv_heads,
            "baseline_top1": round(setup.baseline.top1, 4), "baseline_ppl": round(setup.baseline.ppl, 3),
            "eval_tokens": setup.baseline.tokens, "context": setup.context, "score_from": setup.score_from,
            **({"passkey_original": setup.passkey_summary()} if passkey else {}),
            "methods": rows, **_versus_papers(rows),
            "notes": _notes(spec, rows),
        })
        del setup
    return {
        "benchmark": "frontier", "date": datetime.date.today().isoformat(), "kvfold_version": kvfold.__version__,
        "torch_version": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "target_top1_ratio": target,
        "joint_target": f"top-1 ratio >= {target:g} and perplexity ratio <= {1 / target:.4f} on {eval_text}"
                        + (", and on each of its texts alone" if "+" in eval_text else ""),
        "eval_text": eval_text, "calib_text": calib_text, "calib_tokens": calib_tokens,
        "sensitivity_text": "wiki:dev", "sensitivity_tokens": sensitivity_tokens, "rank_multiple": multiple,
        "bytes": "KV-cache bytes per token as a fraction of the original's at fp16",
        "models": results, "seconds": round(time.perf_counter() - t0, 1),
    }


def _notes(spec: str, rows: list[dict]) -> list[str]:
    """What a reader of this model's numbers must know."""
    notes = []
    if spec in MHA_OF:
        notes.append(f"{spec}: each KV head of {MHA_OF[spec]} repeated for its 3 query heads (same logits); "
                     "bytes are relative to this model's own 3x larger cache")
        if any(r["name"] == "palu" for r in rows):
            notes.append("palu decomposes all KV heads of a layer jointly, so it removes the exact copies "
                         "for free (1/3 of the bytes at any rank); a real MHA model has no copies")
    return notes


def _versus_papers(rows: list[dict]) -> dict:
    """kvfold's compression at the target divided by the papers' (ZACK/FDC) — the headline ratio."""
    by = {r["name"]: r["compression_at_target"] for r in rows}
    if by.get("kvfold") is None or not by.get("zack"):
        return {}
    return {"kvfold_over_papers": round(by["kvfold"] / by["zack"], 2)}
