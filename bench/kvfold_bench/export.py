"""Export at an accuracy target with each factor method, side by side in one run, and check each
checkpoint on held-out text (wiki:eval: used neither for calibration nor for the search).

The held-out figure comes from the written files, loaded as they are served (kvfold-runtime through
transformers' Auto classes, float32 on the CPU, as `kvfold verify` loads them), not from the search.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from kvfold import api
from kvfold.calib.tokens import text_sequences
from kvfold.measure.evaluate import Reference, score_model
from kvfold.plan.recipe import load_recipe
from kvfold.sources.models import load_model, resolve_model
from kvfold.sources.text import resolve_text
from kvfold.verify.serving import load_served

__all__ = ["bench_export"]


def bench_export(model: str, accuracy: float, methods: list[str], calib_tokens: int, eval_tokens: int,
                 heldout_tokens: int, margin: float = 0.0, multiple: int = 8,
                 allocation: str = "sensitivity", metric: str = "joint") -> dict:
    recipes = {m: load_recipe(None, dict(accuracy=accuracy, metric=metric, method=m, eval_tokens=eval_tokens,
                                         margin=margin, multiple=multiple, min_rank=min(8, multiple),
                                         allocation=allocation if m == "aware" else "eq6"))
               for m in methods}  # bad options fail here, in one line, before any work
    ref = resolve_model(model)
    heldout = text_sequences(AutoTokenizer.from_pretrained(ref.path), resolve_text("wiki:eval"),
                             heldout_tokens, 512, seed=0)
    reference = Reference([], [])
    base = score_model(load_model(ref), heldout, keep=reference)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calib"
        api.calibrate(model, calib, text="wiki:calib", tokens=calib_tokens)
        for method in methods:
            t0 = time.perf_counter()
            result = api.export(model, calib, Path(tmp) / method, recipes[method])
            seconds = time.perf_counter() - t0
            m = result.manifest
            held = score_model(load_served(result.output), heldout, against=reference)
            rows.append({
                "method": method, "allocation": m.allocation, "compression_p": round(m.chosen.compression, 4),
                "kv_bytes_fraction": round(1 - m.chosen.compression, 4),
                "search_top1_ratio": round(m.chosen.top1_ratio, 4),
                "search_top1_se": round(m.chosen.top1_se, 4),
                "heldout_top1_ratio": round(held.ratio(base, "top1"), 4),
                "heldout_top1_se": round(held.top1_ratio_se(base), 4),
                "search_ppl_ratio": round(m.chosen.ppl_ratio, 4),
                "heldout_ppl_ratio": round(held.ratio(base, "ppl"), 4),  # ppl / ppl₀
                "heldout_ppl_se": round(held.ppl_ratio_se(base), 4),
                "heldout_agreement": round(held.agreement, 4), "heldout_kl": round(held.kl, 5),
                "r": round(m.chosen.r_k, 5), "curve_points": len(m.curve), "export_s": round(seconds, 1),
            })
    return {
        "benchmark": "export", "model": model, "accuracy": accuracy, "metric": metric, "margin_se": margin,
        "rank_multiple": multiple,
        "calibration": "wiki:calib",
        "calib_tokens": calib_tokens, "search_text": next(iter(recipes.values())).eval_text,
        "search_tokens": eval_tokens,
        "heldout_text": "wiki:eval", "heldout_tokens": base.tokens, "baseline_heldout_top1": round(base.top1, 4),
        "baseline_heldout_ppl": round(base.ppl, 3), "methods": rows,
    }
