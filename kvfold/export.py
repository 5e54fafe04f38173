"""`kvfold export`: statistics -> factors -> ranks for the target -> baked weights -> checkpoint."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

import kvfold
from kvfold.calib.artifact import CalibStats
from kvfold.calib.tokens import text_sequences
from kvfold.checkpoint.manifest import Calibration, Manifest, Point, SourceModel
from kvfold.checkpoint.writer import write_checkpoint
from kvfold.errors import KVFoldError
from kvfold.factors import get_method
from kvfold.factors.positions import fitted_statistics
from kvfold.factors.weights import o_proj_heads
from kvfold.io import atomic_dir
from kvfold.measure.evaluate import Evaluator
from kvfold.measure.passkey import passkey_length, passkey_prompts
from kvfold.plan.bits import SCALE, BitRule, bit_factors, plan_bits
from kvfold.plan.criteria import Target
from kvfold.plan.longrange import NUDGES, keep_passkeys
from kvfold.plan.ranks import RankRule, factors_for, plan_ranks
from kvfold.plan.recipe import Recipe
from kvfold.plan.search import CurvePoint, best_point
from kvfold.plan.sensitivity import LayerWeights, measure_weights
from kvfold.plan.targets import bit_patches, for_accuracy, for_accuracy_bits, for_compression, measure
from kvfold.rewrite.bake import bake
from kvfold.sources.models import DTYPES, load_model, resolve_device, resolve_model, source_dtype, weights_sha256
from kvfold.sources.text import resolve_text
from kvfold.sources.tokenizer import load_tokenizer
from kvfold_runtime import K_POST, Q_POST

__all__ = ["ExportResult", "export"]


@dataclass(frozen=True)
class ExportResult:
    manifest: Manifest
    output: Path


def export(model: str, calib: Path, output: Path, recipe: Recipe, *, reuse_curve: Path | None = None,
           force: bool = False, device: str = "auto", log: Callable[[str], None] = lambda line: None) -> ExportResult:
    """Choose per-head ranks for the recipe's target, bake them, write a checkpoint atomically.

    The model runs in recipe.dtype on `device` (auto: CUDA when present); the baked weights are written in
    the source checkpoint's dtype, from weights read in that dtype.

    With `reuse_curve` (a previous export of the same model, calibration, method and rounding), the
    point is picked from its recorded curve and nothing is evaluated again. `log` gets one plain line
    per stage and per scored candidate."""
    ref = resolve_model(model)
    device = resolve_device(device)
    stats = CalibStats.load(Path(calib))
    sha = weights_sha256(ref.path)
    if stats.header.model.weights_sha256 != sha:
        raise KVFoldError(f"'{calib}' was calibrated on different weights than '{model}' (sha256 differs); "
                          f"run kvfold calibrate {model} first")
    previous = _reusable(Path(reuse_curve), sha, stats, recipe) if reuse_curve else None
    docs = None if previous else resolve_text(recipe.eval_text)
    target = recipe.target()

    with atomic_dir(Path(output), force=force) as tmp:
        net = load_model(ref, recipe.dtype, device)
        method = get_method(recipe.method)
        positions = _positions(recipe, previous, net, ref.adapter.rope)
        fitted = fitted_statistics(stats, net, positions)  # RoPE: every position up to the context, not 0–511
        bases = [method.basis(fitted, i, o_proj_heads(net, ref.adapter, i))
                 for i in range(stats.header.model.num_layers)]

        windows = None if previous else text_sequences(load_tokenizer(ref.path), docs, recipe.eval_tokens, 512,
                                                       seed=0)
        texts = max(1, len(set(windows.parts))) if windows is not None else 1
        if windows is not None and target is not None and target.needs_se() and len(windows.ids) < 2 * texts:
            raise KVFoldError(f"--margin needs a standard error on each text, and {recipe.eval_text} gives fewer "
                              f"than two 512-token windows per text; raise --eval-tokens to {1024 * texts} or "
                              "more, or pass --margin 0")
        if previous is None and recipe.allocation == "sensitivity":
            log(f"measuring per-layer sensitivity on {recipe.sensitivity_tokens} tokens")
        weights = _layer_weights(previous, recipe, bases, net, ref, windows, log)

        bits = recipe.format == "bits"

        def rule(r: float, r_v: float | None = None) -> RankRule | BitRule:
            r_v = recipe.v_scale * r if r_v is None else r_v
            layers = dict(layer_k=weights.k if weights else (), layer_v=weights.v if weights else ())
            if bits:  # r is the water-filling's θ (plan/bits.py)
                return BitRule(theta_k=r, theta_v=r_v, **layers)
            return RankRule(r_k=r, r_v=r_v, multiple=recipe.multiple, min_rank=recipe.min_rank, **layers)

        passkey = None
        if previous is not None:
            curve = [CurvePoint.from_dict(p.model_dump()) for p in previous.curve]
            best, passkey = _pick(curve, recipe, target, previous.passkey)
            measured = dict(eval_text=previous.eval_text, eval_tokens=previous.eval_tokens,
                            baseline_top1=previous.baseline_top1, baseline_ppl=previous.baseline_ppl)
        else:
            log(f"scoring the original on {windows.num_tokens} tokens of {recipe.eval_text}")
            evaluator = Evaluator(net, ref.adapter, windows)
            if target is not None:
                log(f"searching for {target.describe()}")
                started = [time.monotonic()]

                def scored(p: CurvePoint) -> None:  # one line per candidate, with what it took
                    log(f"candidate {_candidate(p, recipe.eval_text)} ({time.monotonic() - started[0]:.0f} s)")
                    started[0] = time.monotonic()

                search = for_accuracy_bits if bits else for_accuracy
                best, curve = search(bases, evaluator, target, rule, progress=scored)
            else:
                best, curve = for_compression(bases, evaluator, recipe.ratio, rule)
            measured = dict(eval_text=recipe.eval_text, eval_tokens=evaluator.baseline.tokens,
                            baseline_top1=evaluator.baseline.top1, baseline_ppl=evaluator.baseline.ppl)
            if target is not None and recipe.passkey:
                # Checked in the checkpoint's own dtype, as it will be served and verified: a key at the edge
                # can flip between dtypes (measured: a bfloat16 search's check kept 10/10, float32 lost one).
                net = _in_source_dtype(net, ref, device)
                like = next(net.parameters())

                def patches_for(p: CurvePoint) -> list[dict]:
                    chosen_ = rule(p.r_k, p.r_v)
                    if bits:  # three roundings of the cache (plan/longrange.py)
                        plan = plan_bits(bases, chosen_)
                        return [bit_patches(bases, plan, like, nudge) for nudge in NUDGES]
                    return [evaluator.patches(factors_for(bases, plan_ranks(bases, chosen_)), like)]

                def between(a: CurvePoint, b: CurvePoint) -> CurvePoint:  # scored as the search scores
                    point = measure(bases, evaluator, rule(math.sqrt(a.r_k * b.r_k), math.sqrt(a.r_v * b.r_v)))
                    scored(point)
                    return point

                best, passkey = _keep_passkeys(net, ref, recipe.passkey, curve, target, patches_for, log, between)
        log(f"chosen: {_candidate(best, recipe.eval_text)}; writing the checkpoint")
        chosen = rule(best.r_k, best.r_v)
        bit_plan = plan_bits(bases, chosen) if bits else None
        ranks = bit_plan.ranks() if bits else plan_ranks(bases, chosen)
        k_bits, v_bits = bit_plan.kept_bits() if bits else (None, None)
        factors = bit_factors(bases, bit_plan) if bits else factors_for(bases, ranks)
        baked = bake(_in_source_dtype(net, ref, device), ref.adapter, factors)
        h = stats.header
        manifest = Manifest(
            kvfold_version=kvfold.__version__, torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            source=SourceModel(spec=model, path=str(ref.path.resolve()), architecture=ref.architecture,
                               weights_sha256=sha),
            calibration=Calibration(source=h.options.source, text=h.options.text, tokens=h.tokens,
                                    seed=h.options.seed, stats_sha256=h.stats_sha256),
            method=recipe.method, metric=recipe.metric,
            target=f"compression>={recipe.ratio}" if target is None else target.describe(),
            target_level=None if target is None else target.level, margin=0.0 if target is None else target.margin,
            rounding_multiple=1 if bits else recipe.multiple, min_rank=0 if bits else recipe.min_rank,
            head_dim=h.model.head_dim, k_bits=k_bits, v_bits=v_bits, band_scale=chosen.scale if bits else "float16",
            allocation=recipe.allocation, positions=positions, search_dtype=recipe.dtype, passkey=passkey,
            **_weight_fields(weights),
            num_heads=h.model.num_heads, num_kv_heads=h.model.num_kv_heads, d_k=ranks.d_k, d_v=ranks.d_v,
            chosen=Point.model_validate(best.to_dict()), curve=[Point.model_validate(p.to_dict()) for p in curve],
            extra_tensors=sorted(n for n, _ in baked.named_parameters() if n.endswith((Q_POST, K_POST))),
            **measured,
        )
        manifest = write_checkpoint(baked, ref.path, manifest, tmp)
    return ExportResult(manifest=manifest, output=Path(output))


def _layer_weights(previous: Manifest | None, recipe: Recipe, bases, net, ref, windows,
                   log: Callable[[str], None]) -> LayerWeights | None:
    """Per-layer rate multipliers: recorded in a previous export, measured now, or none (eq6)."""
    if recipe.allocation == "eq6":
        return None
    if previous is not None:
        return LayerWeights(tuple(previous.layer_scale_k), tuple(previous.layer_scale_v),
                            tuple(previous.layer_cost_k), tuple(previous.layer_cost_v))
    n = max(1, -(-recipe.sensitivity_tokens // 512))  # whole 512-token windows from the start of the text
    probe = Evaluator(net, ref.adapter, windows.head(n), replay=True, compare=False)
    return measure_weights(bases, probe, recipe.min_rank, progress=log)


def _weight_fields(weights: LayerWeights | None) -> dict:
    if weights is None:
        return {}
    return dict(layer_scale_k=list(weights.k), layer_scale_v=list(weights.v), layer_cost_k=list(weights.cost_k),
                layer_cost_v=list(weights.cost_v))


def _candidate(p: CurvePoint, texts: str = "") -> str:
    """One candidate's figures; on a mixture of texts, each text's top-1 and perplexity ratios too."""
    line = (f"p={p.compression:.4f}: top-1 ratio {p.top1_ratio:.4f} ± {p.top1_se:.4f}, perplexity ratio "
            f"{p.ppl_ratio:.4f} ± {p.ppl_se:.4f}, agreement {p.agreement:.4f}, mean KL {p.kl:.5f}")
    names = texts.split("+")
    if p.parts and len(names) == len(p.parts):
        line += "; " + ", ".join(f"{n} {q.top1_ratio:.4f} / {q.ppl_ratio:.4f} ± {q.ppl_se:.4f}"
                                 for n, q in zip(names, p.parts, strict=True))
    return line


def _reusable(path: Path, sha: str, stats: CalibStats, recipe: Recipe) -> Manifest:
    prev = Manifest.load(path)
    checks = [
        ("model weights", prev.source.weights_sha256, sha),
        ("calibration", prev.calibration.stats_sha256, stats.header.stats_sha256),
        ("method", prev.method, recipe.method),
        ("rank rounding", (prev.rounding_multiple, prev.min_rank),
         (1, 0) if recipe.format == "bits" else (recipe.multiple, recipe.min_rank)),
        ("rank allocation", prev.allocation, recipe.allocation),
        ("cache format", "bits" if prev.k_bits is not None else "rank", recipe.format),
        # bits exports before schema 1.6 stored float16 scales and did not mix their bands
        ("band scale format", prev.band_scale if prev.k_bits is not None else None,
         SCALE if recipe.format == "bits" else None),
        ("--dtype", prev.search_dtype, recipe.dtype),
    ]
    for what, theirs, ours in checks:
        if theirs != ours:
            raise KVFoldError(f"--reuse-curve: '{path}' was searched with a different {what}; "
                              "export without --reuse-curve")
    return prev


def _positions(recipe: Recipe, previous: Manifest | None, net, rope: bool) -> int | None:
    """The context the query/key statistics are averaged over: None for a model without RoPE or --context 0;
    a reused curve keeps its own."""
    if previous is not None:
        if recipe.context is not None and (recipe.context or None) != previous.positions:
            raise KVFoldError(f"--reuse-curve: that export was fitted for --context {previous.positions or 0}; "
                              "export without --reuse-curve, or drop --context")
        return previous.positions
    if not rope or recipe.context == 0:
        return None
    return recipe.context or net.config.get_text_config().max_position_embeddings


def _pick(curve: list[CurvePoint], recipe: Recipe, target: Target | None,
          checked: dict | None) -> tuple[CurvePoint, dict | None]:
    """A point of a recorded curve, and its pass-key record when the previous export checked that very point.
    Points whose pass-key check failed there are not picked."""
    if target is not None:
        rejected = {r["compression"] for r in (checked or {}).get("rejected", [])}
        best = best_point([p for p in curve if p.compression not in rejected] or curve, target,
                          where="on the recorded curve")
        same = checked is not None and checked.get("compression") == best.compression
        return best, checked if same else None
    ok = [p for p in curve if p.compression >= recipe.ratio]
    if not ok:
        raise KVFoldError(f"no recorded point reaches compression {recipe.ratio}; export without --reuse-curve")
    return min(ok, key=lambda p: p.compression), None


def _in_source_dtype(net, ref, device: str):
    """`net` itself, or the model read again in the source checkpoint's dtype when the search ran in another:
    what is baked and written, and what the pass keys are checked on."""
    stored = source_dtype(ref)
    if next(net.parameters()).dtype == DTYPES[stored]:
        return net
    return load_model(ref, stored, device)


def _keep_passkeys(net, ref, context: int, curve: list[CurvePoint], target: Target, patches_for,
                   log: Callable[[str], None], between) -> tuple[CurvePoint, dict]:
    """plan/longrange.py on prompts of `context` tokens, or the model's whole context if shorter; skipped, and
    recorded as such, where that has no room for the task. Points scored on the way join `curve`."""
    try:
        prompts = passkey_prompts(load_tokenizer(ref.path), passkey_length(net, context))
    except KVFoldError as e:
        log(f"pass keys not checked: {e}")
        return best_point(curve, target), {"skipped": str(e)}
    log(f"pass keys at {len(prompts[0].ids)} tokens: the most compressed passing point that keeps the original's")
    best, record, added = keep_passkeys(net, ref.adapter, prompts, curve, target, patches_for, log, between)
    curve[:] = sorted([*curve, *added], key=lambda p: (p.r_k, p.r_v))
    return best, record
