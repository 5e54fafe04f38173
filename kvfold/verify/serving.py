"""What an export does when served: load it through kvfold-runtime (its public API only) next to the
original model, and compare on held-out text, in live KV-cache bytes, and in a greedy generation."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvfold.calib.tokens import text_sequences
from kvfold.checkpoint.manifest import Manifest
from kvfold.plan.evaluate import score_model
from kvfold.sources.models import ModelRef, load_model, weights_sha256
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold.verify.report import Check, VerifyReport
from kvfold.verify.runtime import require_runtime

__all__ = ["SAME_TEXT_TOLERANCE", "expected_kv_bytes", "serving_checks"]

# Same text and tokens as the export's search: only numerics differ (the search scored the
# projections patched into the original; here the baked weights run), so the ratios must agree to
# within a few near-tie argmax flips: 0.2%, or two tokens on short texts.
SAME_TEXT_TOLERANCE = 0.002
# Different text: both ratios are estimates with paired standard errors; agree within 3 combined σ.
SIGMAS = 3.0


def load_served(directory: Path):
    require_runtime()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _live_cache(model, ids: torch.Tensor):
    """The KV cache after one forward over `ids`."""
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True).past_key_values


def expected_kv_bytes(original_cache, d_k: list[list[int]], d_v: list[list[int]]) -> int:
    """Bytes the export's cache must hold for the same tokens: in every layer, as many tokens as the
    original's layer holds (all of them, or a sliding window's last ones) at that layer's widths
    Σd_k + Σd_v, in the same dtype. Equals (1 − p) × the original's bytes only when every layer holds
    every token."""
    total = 0
    for layer, k, v in zip(original_cache.layers, d_k, d_v, strict=True):
        keys = layer.keys  # [B, H_kv, T_held, d]
        total += keys.shape[0] * keys.shape[-2] * (sum(k) + sum(v)) * keys.element_size()
    return total


def _generate(model, tokenizer, ids: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def serving_checks(directory: Path, m: Manifest, against: ModelRef, report: VerifyReport, eval_text: str,
                   eval_tokens: int, new_tokens: int = 32) -> None:
    """Fill `report` with the served export's figures and checks."""
    if weights_sha256(against.path) != m.source.weights_sha256:
        report.checks.append(Check("against", False, f"{against.path} is not the model this was exported from "
                                                     "(weights sha256 differ); pass --against the source"))
        return
    tokenizer = load_tokenizer(directory)
    original, served = load_model(against), load_served(directory)
    report.checks.append(Check("loads", type(served).__name__.startswith("KVFold"),
                               f"transformers loads it as {type(served).__name__}"))

    windows = text_sequences(tokenizer, resolve_text(eval_text), eval_tokens, 512, seed=0)
    base, comp = score_model(original, windows), score_model(served, windows)
    report.eval_text, report.eval_tokens = eval_text, base.tokens
    report.metric = m.metric
    report.metric_ratio, report.ppl_ratio = comp.ratio(base, m.metric), comp.ratio(base, "ppl")
    report.metric_ratio_se = comp.top1_ratio_se(base) if m.metric == "top1" else None
    recorded = m.chosen.top1_ratio if m.metric == "top1" else m.chosen.ppl_ratio
    same = eval_text == m.eval_text and base.tokens == m.eval_tokens
    if same or m.metric != "top1":
        tol = max(SAME_TEXT_TOLERANCE, 2 / base.tokens) if same else 0.01
        how = "same text as the export's search" if same else "perplexity ratio on other text"
    elif math.isnan(m.chosen.top1_se) or math.isnan(report.metric_ratio_se):
        tol, how = 0.01, "1%: no standard error with a single text window"
    else:
        tol = SIGMAS * math.hypot(m.chosen.top1_se, report.metric_ratio_se)
        how = f"{SIGMAS:g} combined standard errors (export searched on {m.eval_text})"
    report.recorded_ratio, report.tolerance = recorded, tol
    agree = abs(report.metric_ratio - recorded) <= tol
    report.checks.append(Check("fidelity", agree, f"{m.metric} ratio {report.metric_ratio:.4f} on {eval_text} vs "
                                                  f"{recorded:.4f} recorded at export; tolerance ±{tol:.4f} ({how})"))

    ids = windows.ids[0][None]  # one evaluation window, [1, T]
    caches = {"original": _live_cache(original, ids), "exported": _live_cache(served, ids)}
    total = {k: require_runtime().kv_cache_bytes(c) for k, c in caches.items()}
    expected = expected_kv_bytes(caches["original"], m.d_k, m.d_v)
    per_token = {k: v / ids.numel() for k, v in total.items()}
    report.kv_bytes_per_token = {k: int(v) if v == int(v) else v for k, v in per_token.items()}
    report.kv_bytes_ratio = total["exported"] / total["original"]
    report.expected_kv_bytes_ratio = expected / total["original"]
    report.checks.append(Check("kv_bytes", total["exported"] == expected,
                               f"{per_token['exported']:g} vs {per_token['original']:g} bytes per token in the live "
                               f"cache = {report.kv_bytes_ratio:.4f}; expected from the manifest's ranks and the "
                               f"tokens each layer holds {report.expected_kv_bytes_ratio:.4f} (1 − p = "
                               f"{1 - m.chosen.compression:.4f})"))

    prompt = windows.ids[0][None, :24]
    a, b = _generate(original, tokenizer, prompt, new_tokens), _generate(served, tokenizer, prompt, new_tokens)
    same_prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                       min(len(a), len(b)))  # either may stop early at EOS
    report.generation = {"prompt": tokenizer.decode(prompt[0]), "original": tokenizer.decode(a),
                         "exported": tokenizer.decode(b), "identical_tokens": same_prefix, "new_tokens": len(a)}
