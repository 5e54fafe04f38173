"""What an export does when served: load it through kvfold-runtime (its public API only) next to the
original model, and compare on held-out text, in live KV-cache bytes, and in a greedy generation."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from kvfold.calib.tokens import text_sequences
from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.measure.evaluate import Reference, score_model
from kvfold.measure.passkey import passkey_answers, passkey_length, passkey_prompts, passkey_summary
from kvfold.plan.point import Point
from kvfold.progress import progress
from kvfold.sources.models import ModelRef, from_pretrained, load_model, weights_sha256
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold.verify.pair import load_original_beside
from kvfold.verify.report import Check, VerifyReport
from kvfold.verify.runtime import require_runtime
from kvfold_runtime import ConfigBlock

__all__ = ["HELD_OUT_SIGMAS", "SAME_TEXT_TOLERANCE", "SEARCH_CONTEXT", "expected_kv_bytes", "serving_checks"]

# Same text and tokens as the export's search: only numerics differ (the search scored the
# projections patched into the original; here the baked weights run), so the ratios must agree to
# within a few near-tie argmax flips: 0.2%, or two tokens on short texts.
SAME_TEXT_TOLERANCE = 0.002
# Held-out text: the export's target must hold within this many paired standard errors (each figure is
# an estimate; a point chosen with a 1-se margin on the search text still has noise on other text).
HELD_OUT_SIGMAS = 2.0
# An export made for a compression has no target: its top-1 ratio must agree with the recorded one
# within this many combined standard errors.
SIGMAS = 3.0
PROMPTS, PROMPT_TOKENS = 4, 24  # greedy generations compared, from the first evaluation text
KV_BYTES_TOKENS = 128  # tokens whose live cache the kv_bytes check weighs (past the tiny models' 16-token windows)
SEARCH_CONTEXT = 512  # the window length export's search scores (calib.tokens windows)


def load_served(directory: Path, dtype: str = "float32", device: str = "cpu", device_map: str | None = None):
    require_runtime()
    return from_pretrained(directory, dtype, device, device_map)


def _live_cache(model, ids: torch.Tensor):
    """The KV cache after one forward over `ids`."""
    with torch.inference_mode():
        return model(input_ids=ids.to(model.device), use_cache=True).past_key_values


def expected_kv_bytes(original_cache, block: ConfigBlock) -> int:
    """Bytes the export's cache must hold for the same tokens: in every layer, as many tokens as the
    original's layer holds (all of them, or a sliding window's last ones) at that layer's widths
    Σd_k + Σd_v, in the same dtype — or, for a bits-format export, that layer's band rows (codes and
    scales) per token: LayerDims.row_bytes. Equals (1 − p) × the original's bytes only when every layer
    holds every token (and, for bits, the original's cache is float16). A windowed bits export also holds its first
    `sinks` and last `window` tokens' rows whole, in the same dtype (kvfold_runtime's WindowLayer)."""
    total = 0
    dims = block.layers(1, len(block.d_k[0]))  # the group does not change a cached row
    for layer, widths in zip(original_cache.layers, dims, strict=True):
        keys = layer.keys  # [B, H_kv, T_held, d]
        batch, held, size = keys.shape[0], keys.shape[-2], keys.element_size()
        total += batch * held * sum(widths.row_bytes(size))
        whole = min(held, block.sinks) + min(held, block.window)
        total += batch * whole * (sum(widths.d_k) + sum(widths.d_v)) * size
    return total


def _generate(model, tokenizer, prompts: torch.Tensor, new_tokens: int, description: str) -> list[list[int]]:
    """Greedy continuations of equal-length prompts [N, T] in one batch, each cut after its first end-of-sequence
    token (where generate stops a prompt of its own). One batch: a decode step reads every weight whatever the
    batch (Qwen2.5-Coder-1.5B in float32 on 2 cores: a step of 4 prompts took 2.8× one of 1, and verify's
    generations 96 s instead of 135 s one by one). Its progress: a stage named `description`, a step a token."""
    with torch.inference_mode(), progress(description, new_tokens, "tokens") as advance:
        ids = prompts.to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, streamer=_Steps(advance))
    eos = model.generation_config.eos_token_id
    stops = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    rows = out[:, prompts.shape[1]:].cpu().tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in rows]


class _Steps(BaseStreamer):
    """generate's streamer that only counts decoding steps: its first put is the prompt, each later one a token."""

    def __init__(self, advance) -> None:
        self.advance, self.prompt = advance, True

    def put(self, value) -> None:
        if self.prompt:
            self.prompt = False
        else:
            self.advance()

    def end(self) -> None:
        pass


def _forced_agreement(model, prompt: torch.Tensor, continuation: list[int]) -> list[bool]:
    """Teacher-forced on the original's own continuation: is the model's next token the original's, at each
    step? Unlike free-running generation, one early difference does not decide every later position."""
    if not continuation:
        return []
    ids = torch.cat([prompt[0], torch.tensor(continuation)])[None]
    with torch.inference_mode():
        top = model(input_ids=ids.to(model.device), use_cache=False).logits[0, prompt.shape[1] - 1:-1].argmax(-1)
    return (top.cpu() == torch.tensor(continuation)).tolist()


def serving_checks(directory: Path, m: Manifest, against: ModelRef, report: VerifyReport, eval_texts: list[str],
                   eval_tokens: int, context: int = SEARCH_CONTEXT, passkey: int = 0, new_tokens: int = 32,
                   dtype: str = "float32", device: str = "cpu", device_map: str | None = None,
                   score_from: int = 1) -> None:
    """Fill `report` with the served export's figures and checks: windows of `context` tokens scored from position
    `score_from` on, passkey
    prompts of `passkey` tokens (0: none); both models run in `dtype` on `device` (with `device_map`, each placed
    by accelerate)."""
    if weights_sha256(against.path) != m.source.weights_sha256:
        report.checks.append(Check("against", False, f"{against.path} is not the model this was exported from "
                                                     "(weights sha256 differ); pass --against the source"))
        return
    tokenizer = load_tokenizer(directory)
    # the original is built around the served model's tensors: the weights the export left unchanged exist once
    served = load_served(directory, dtype, device, device_map)
    original = (load_model(against, dtype, device, device_map) if device_map  # offloaded tensors: none to share
                else load_original_beside(served, against, dtype, device))
    report.checks.append(Check("loads", type(served).__name__.startswith("KVFold"),
                               f"transformers loads it as {type(served).__name__}"))
    report.metric, report.target = m.metric, m.target

    first = None
    for text in eval_texts:
        windows = text_sequences(tokenizer, resolve_text(text), eval_tokens, context, seed=0)
        first = first or windows
        reference = Reference([], [])
        batch = max(1, 2048 // context)  # the logits of 2,048 tokens at a time (400 MB at SmolLM2's vocabulary)
        base = score_model(original, windows, batch, keep=reference, description=f"{text}: the original",
                           start=score_from)
        point = Point.measured(0.0, 0.0, m.chosen.compression, score_model(
            served, windows, batch, against=reference, description=f"{text}: the export", start=score_from), base)
        report.texts.append({"eval_text": text, "context": context, "score_from": score_from, "tokens": base.tokens,
                             "baseline_top1": base.top1,
                             "baseline_ppl": base.ppl, **{k: v for k, v in asdict(point).items()
                                                          if k not in ("r_k", "r_v", "compression")}})
        # The recorded figures are reproducible only from the search's windows, run in the search's dtype.
        same = (context, score_from, dtype) == (m.search_context, m.score_from, m.search_dtype)
        report.checks.append(_fidelity(m, text, base.tokens, point, same_windows=same))
    if passkey:
        _passkey(tokenizer, original, served, passkey, report)

    # The live cache of the first window's first tokens: bytes per token are the same at any length (a sliding
    # window's cap is counted by expected_kv_bytes), and a forward over the whole window took 20 s a model for
    # Qwen2.5-Coder-1.5B in float32 on 2 cores.
    ids = first.ids[0][None, :KV_BYTES_TOKENS]  # [1, T]
    caches = {"original": _live_cache(original, ids), "exported": _live_cache(served, ids)}
    total = {k: require_runtime().kv_cache_bytes(c) for k, c in caches.items()}
    expected = expected_kv_bytes(caches["original"], m.config_block())
    per_token = {k: v / ids.numel() for k, v in total.items()}
    report.kv_bytes_per_token = {k: int(v) if v == int(v) else v for k, v in per_token.items()}
    report.kv_bytes_ratio = total["exported"] / total["original"]
    report.expected_kv_bytes_ratio = expected / total["original"]
    report.checks.append(Check("kv_bytes", total["exported"] == expected,
                               f"{per_token['exported']:g} vs {per_token['original']:g} bytes per token in the live "
                               f"cache = {report.kv_bytes_ratio:.4f}; expected from the manifest's "
                               f"{'bit bands' if m.k_bits else 'ranks'} and the tokens each layer holds "
                               f"{report.expected_kv_bytes_ratio:.4f} (1 − p = {1 - m.chosen.compression:.4f}"
                               f"{' of float16' if m.k_bits else ''}){_at_length(m, context, report)}"))
    _generation(m, tokenizer, original, served, first, new_tokens, report)


def _at_length(m: Manifest, context: int, report: VerifyReport) -> str:
    """A windowed export's bytes a token fall with the context (its whole tokens are a fixed count), so the live
    cache of KV_BYTES_TOKENS tokens, mostly whole, says little of them: its fraction of float16's bytes at the
    verified context and at 32K, by the runtime's accounting (Manifest.kv_fraction), which the live check above
    confirms at its length. Recorded in `report`; the words for the check."""
    if not m.config_block().windowed:
        return ""
    report.kv_fraction_at = {str(n): m.kv_fraction(n) for n in sorted({context, 32768})}
    return "; " + ", ".join(f"{f:.4f} of float16 at {int(n):,} tokens" for n, f in report.kv_fraction_at.items())


def _passkey(tokenizer, original, served, context: int, report: VerifyReport) -> None:
    """Passkey retrieval at `context` tokens, or the model's whole context if shorter (measure/passkey.py): the
    export must retrieve as many keys as the original ("no worse": a retrieval rate, so one key won where
    another is lost is a tie; the keys lost are named in the detail). Skipped, and said so, where the model's
    context has no room for the task."""
    context = passkey_length(original, context)
    try:
        prompts = passkey_prompts(tokenizer, context)
    except KVFoldError as e:
        report.passkey = {"skipped": f"the model's context of {context} tokens is too short ({e})"}
        return
    orig = passkey_answers(original, prompts, "pass keys: the original")
    exp = passkey_answers(served, prompts, "pass keys: the export")
    hits = {"original": orig.hits, "exported": exp.hits}
    # beside the counts, the answers' NLL (and the export's change against the original, paired by prompt) and
    # their smallest logit margin: how close the nearest key is to flipping
    report.passkey = {"original": passkey_summary(prompts, orig.hits, orig.nlls, margins=orig.margins),
                      "exported": passkey_summary(prompts, exp.hits, exp.nlls, against=orig.nlls,
                                                  margins=exp.margins)}
    lost = sum(a and not b for a, b in zip(hits["original"], hits["exported"], strict=True))
    n, got = len(prompts), {k: sum(h) for k, h in hits.items()}
    depths = ", ".join(report.passkey["exported"]["by_depth"])
    change = report.passkey["exported"]["answer_nll_change"]
    report.checks.append(Check(
        f"passkey {context}", got["exported"] >= got["original"],
        f"keys retrieved at {len(prompts[0].ids)} tokens, needle at depths {depths}: export {got['exported']}/{n}, "
        f"original {got['original']}/{n}" + (f"; {lost} the original retrieves are lost" if lost else "")
        + f"; the answers' NLL {change['mean']:+.3f} ± {change['se']:.3f} nats against the original's; smallest "
        f"answer margin {report.passkey['exported']['smallest_margin']:+.2f} (original "
        f"{report.passkey['original']['smallest_margin']:+.2f})"))


def _fidelity(m: Manifest, text: str, tokens: int, now: Point, same_windows: bool = True) -> Check:
    """Same text and windows as the search: the recorded figures again. Other text: the target holds (within
    HELD_OUT_SIGMAS standard errors); without a target, the recorded top-1 ratio within SIGMAS."""
    rec, target = m.chosen, m.accuracy_target()
    if text == m.eval_text and tokens == m.eval_tokens and same_windows:
        tol = max(SAME_TEXT_TOLERANCE, 2 / tokens)
        ok = abs(now.top1_ratio - rec.top1_ratio) <= tol and abs(now.ppl_ratio - rec.ppl_ratio) <= tol
        return Check(f"fidelity {text}", ok, f"top-1 ratio {now.top1_ratio:.4f}, perplexity ratio {now.ppl_ratio:.4f} "
                     f"vs {rec.top1_ratio:.4f}, {rec.ppl_ratio:.4f} recorded at export on the same text; "
                     f"tolerance ±{tol:.4f}")
    if target is not None:
        figures = target.values(now)
        if target.metric != "kl":
            figures += f"; mean KL {now.kl:.5f}"
        return Check(f"target {text}", target.met(now, margin=-HELD_OUT_SIGMAS),
                     f"{figures} on {tokens} held-out tokens; target {target.describe().split(' (')[0]} "
                     f"within {HELD_OUT_SIGMAS:g} standard errors")
    if math.isnan(rec.top1_se) or math.isnan(now.top1_se):
        tol, how = 0.01, "1%: no standard error with a single text window"
    else:
        tol, how = SIGMAS * math.hypot(rec.top1_se, now.top1_se), f"{SIGMAS:g} combined standard errors"
    return Check(f"fidelity {text}", abs(now.top1_ratio - rec.top1_ratio) <= tol,
                 f"top-1 ratio {now.top1_ratio:.4f} vs {rec.top1_ratio:.4f} recorded at export on {m.eval_text}; "
                 f"tolerance ±{tol:.4f} ({how})")


def _generation(m: Manifest, tokenizer, original, served, windows, new_tokens: int, report: VerifyReport) -> None:
    """Greedy continuations of a few prompts by both models: where each first differs, and how often the
    export's next token is the original's when both read the original's continuation. With a top-1
    agreement target that agreement is a check (it must not fall below the target by more than
    HELD_OUT_SIGMAS binomial standard errors); otherwise it is reported."""
    runs, forced = [], []
    stream = torch.cat(windows.ids)
    step = max(1, (len(stream) - PROMPT_TOKENS) // PROMPTS)
    # prompts spread over the text, whatever its window count
    pieces = [stream[start:start + PROMPT_TOKENS] for start in range(0, step * PROMPTS, step)]
    length = min(len(piece) for piece in pieces)  # one length for the batch (a short text's pieces are cut)
    prompts = torch.stack([piece[:length] for piece in pieces])
    originals = _generate(original, tokenizer, prompts, new_tokens, "generating: the original")
    exported = _generate(served, tokenizer, prompts, new_tokens, "generating: the export")
    for prompt, a, b in zip(prompts[:, None], originals, exported, strict=True):
        diverge = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if diverge is None and len(a) != len(b):  # one stopped at EOS
            diverge = min(len(a), len(b))
        forced += _forced_agreement(served, prompt, a)
        runs.append({"prompt": tokenizer.decode(prompt[0]), "original": tokenizer.decode(a),
                     "exported": tokenizer.decode(b), "first_divergence": diverge, "new_tokens": len(a)})
    agreement = sum(forced) / len(forced) if forced else float("nan")
    report.generation = {"runs": runs, "forced_agreement": agreement, "forced_tokens": len(forced)}
    target = m.accuracy_target()
    if target is not None and target.metric == "agree" and forced:
        floor = target.level - HELD_OUT_SIGMAS * math.sqrt(target.level * (1 - target.level) / len(forced))
        report.checks.append(Check("generation", agreement >= floor,
                                   f"the export's next token is the original's on {agreement:.4f} of {len(forced)} "
                                   f"positions of the original's greedy continuations; needs ≥ {floor:.4f} "
                                   f"(agreement target {target.level:g} less {HELD_OUT_SIGMAS:g} binomial se)"))
