"""`plan_export`: from checked inputs (plan/reuse.check_inputs) to an ExportPlan — factor bases fitted to the
statistics, per-layer rates, the search for the target (or a recorded curve's point), the pass-key check, and
the chosen point's ranks, bits and factors. Nothing is baked or written here (export.py does that)."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import NamedTuple

from torch import nn

from kvfold.adapters import HeadLayout
from kvfold.calib.tokens import Sequences, text_sequences
from kvfold.errors import KVFoldError
from kvfold.factors import LayerBasis, get_method
from kvfold.factors.positions import fitted_statistics, with_key_shift
from kvfold.factors.weights import o_proj_heads
from kvfold.measure.evaluate import Evaluator
from kvfold.measure.passkey import passkey_length, passkey_prompts
from kvfold.plan.bits import BitRule
from kvfold.plan.criteria import Target
from kvfold.plan.export_plan import Baseline, ExportInputs, ExportPlan
from kvfold.plan.formats import CacheFormat, get_format
from kvfold.plan.journal import Journal
from kvfold.plan.longrange import PasskeysLost, keep_passkeys
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankRule
from kvfold.plan.recipe import Recipe
from kvfold.plan.reuse import context_positions, pick
from kvfold.plan.rounding import HeadScales
from kvfold.plan.search import best_point
from kvfold.plan.sensitivity import LayerScales
from kvfold.plan.targets import for_compression
from kvfold.sources.models import DTYPES, ModelRef, load_model, source_dtype
from kvfold.sources.tokenizer import load_tokenizer

__all__ = ["plan_export"]

Log = Callable[[str], None]
Rule = Callable[..., RankRule | BitRule]  # (r, r_v=None) -> the searched family's member


class _Found(NamedTuple):
    best: Point
    curve: tuple[Point, ...]
    baseline: Baseline
    passkey: dict | None
    model: nn.Module  # the model the search and the pass-key check ran
    rule: Rule  # the family searched (at the key floor _search_floors chose)
    lost: bool = False  # `best` lost a pass key (a first_only check: the caller searches again)


def plan_export(inputs: ExportInputs, device: str = "cpu", log: Log = lambda line: None,
                device_map: str | None = None, journal: Journal | None = None) -> ExportPlan:
    """Choose the point for the recipe's target and everything baking it needs.

    The model runs in recipe.dtype on `device` (with `device_map`, placed by accelerate); the plan's model is in
    the source checkpoint's dtype. With a previous export (inputs.previous), the point is picked from its recorded
    curve and nothing is evaluated. `log` gets one plain line per stage and per scored candidate. What differs
    between cache formats, the recipe's format object decides (plan/formats). The candidates and pass-key answers
    `journal` holds are taken from it, and those measured are added to it (plan/journal.py)."""
    ref, recipe, previous, identity = inputs.ref, inputs.recipe, inputs.previous, inputs.stats.header.model
    fmt = get_format(recipe.format)
    target = recipe.target()
    net = load_model(ref, recipe.dtype, device, device_map)
    method = get_method(recipe.method)
    positions = context_positions(recipe, previous, net, ref.adapter.rope)
    fitted = fitted_statistics(inputs.stats, net, positions)  # RoPE: every position up to the context, not 0–511
    bases = [method.basis(fitted, i, o_proj_heads(net, ref.adapter, i)) for i in range(identity.num_layers)]
    bases = with_key_shift(bases, fitted, net, ref.adapter.rope)
    windows = None if previous else _windows(inputs, target)
    if previous is None and recipe.allocation == "sensitivity":
        log(f"measuring each {fmt.sensitivity_of} sensitivity on {recipe.sensitivity_tokens} tokens")
    scales = _layer_scales(inputs, fmt, bases, net, windows, log)
    rule = partial(_rule, recipe, scales)
    if previous is not None:
        best, passkey = pick(previous.curve, recipe, target, previous.passkey)
        found = _Found(best, previous.curve, previous.baseline, passkey, net, rule)
    else:
        found = _search_floors(inputs, fmt, net, bases, windows, target, scales, log, journal or Journal(None))
    chosen = found.rule(found.best.r_k, found.best.r_v)
    ranks, bits, factors = fmt.export_parts(bases, chosen)
    reload = _reload_for_bake(found.model, ref, device)
    model = found.model if reload is None else None
    found, net = found._replace(model=None), None  # a search model read again is freed first: one model at a time
    if model is None:
        gc.collect()
        model = load_model(ref, *reload)
    return ExportPlan(
        model=model,
        layout=HeadLayout(identity.num_layers, identity.num_heads, identity.num_kv_heads, identity.head_dim),
        method=recipe.method, metric=recipe.metric, target=target, ratio=recipe.ratio, allocation=recipe.allocation,
        search_dtype=recipe.dtype, positions=positions, scales=scales, rule=chosen, ranks=ranks, bits=bits,
        factors=tuple(factors), chosen=found.best, curve=found.curve, baseline=found.baseline, passkey=found.passkey,
        format=fmt.name)


def _rule(recipe: Recipe, scales: LayerScales | HeadScales | None, r: float, r_v: float | None = None
          ) -> RankRule | BitRule:
    """The searched family's member at knob r (r_v = v_scale·r unless given), as the recipe's format makes it: a
    rank rule, or for the bits format a bit rule whose knob is the water-filling's θ (plan/bits.py)."""
    r_v = recipe.v_scale * r if r_v is None else r_v
    if isinstance(scales, HeadScales):  # bits, sensitivity (plan/rounding.py)
        multipliers = dict(head_k=scales.k, head_v=scales.v)
    else:  # per layer: the rank format's sensitivity, or a bits export's before schema 1.9 (a reused curve)
        multipliers = dict(layer_k=scales.k if scales else (), layer_v=scales.v if scales else ())
    return get_format(recipe.format).rule(recipe, r, r_v, multipliers)


def _windows(inputs: ExportInputs, target: Target | None) -> Sequences:
    """The windows of the evaluation text that every candidate is scored on (--search-context tokens each)."""
    recipe = inputs.recipe
    n = recipe.search_context
    windows = text_sequences(load_tokenizer(inputs.ref.path), inputs.docs, recipe.eval_tokens, n, seed=0)
    texts = max(1, len(set(windows.parts)))
    if target is not None and target.needs_se() and len(windows.ids) < 2 * texts:
        raise KVFoldError(f"--margin needs a standard error on each text, and {recipe.eval_text} gives fewer "
                          f"than two {n}-token windows per text; raise --eval-tokens to {2 * n * texts} or "
                          "more, or pass --margin 0")
    return windows


def _layer_scales(inputs: ExportInputs, fmt: CacheFormat, bases: list[LayerBasis], net: nn.Module,
                  windows: Sequences | None, log: Log) -> LayerScales | HeadScales | None:
    """Per-layer rate multipliers (rank format: plan/sensitivity.py) or per-head θ multipliers (bits format:
    plan/rounding.py): recorded in a previous export, measured now, or none (eq6)."""
    recipe = inputs.recipe
    if recipe.allocation == "eq6":
        return None
    if inputs.previous is not None:
        return inputs.previous.scales
    n = max(1, -(-recipe.sensitivity_tokens // recipe.search_context))  # whole windows from the text's start
    probe = Evaluator(net, inputs.ref.adapter, windows.head(n), replay=True, compare=fmt.sensitivity_compares,
                      start=recipe.score_from)
    return fmt.sensitivity(bases, probe, recipe, log)


class _Scoring(NamedTuple):
    """The original scored once on the search's windows: every search of an export compares with it."""
    evaluator: Evaluator
    baseline: Baseline

    @classmethod
    def of(cls, inputs: ExportInputs, net: nn.Module, windows: Sequences, journal: Journal, log: Log) -> _Scoring:
        recipe = inputs.recipe
        log(f"scoring the original on {windows.num_tokens} tokens of {recipe.eval_text}")
        evaluator = Evaluator(net, inputs.ref.adapter, windows, start=recipe.score_from)
        base = evaluator.baseline
        journal.check_baseline(base)
        return cls(evaluator, Baseline(eval_text=recipe.eval_text, eval_tokens=base.tokens, top1=base.top1,
                                       ppl=base.ppl, context=recipe.search_context, score_from=recipe.score_from))


def _search_floors(inputs: ExportInputs, fmt: CacheFormat, net: nn.Module, bases: list[LayerBasis],
                   windows: Sequences, target: Target | None, scales: LayerScales | HeadScales | None, log: Log,
                   journal: Journal) -> _Found:
    """The search at each key floor the format gives (CacheFormat.key_floors; one, the recipe's own, but for a
    windowed bits export without --key-bits) in turn: the first whose own point keeps the pass keys as it is, or the
    last's with the usual pass-key check. The manifest's pass-key record names the floors that lost."""
    scoring = _Scoring.of(inputs, net, windows, journal, log)
    floors, lower = fmt.key_floors(inputs.recipe), []
    for floor in floors:
        recipe = inputs.recipe.model_copy(update={"key_bits": floor})
        last = floor == floors[-1]
        if len(floors) > 1:
            log(f"keys down to {floor} bits" + ("" if last else " (taken if its point keeps the pass keys as it is)"))
        found = _search(replace(inputs, recipe=recipe), fmt, net, bases, scoring, target,
                        partial(_rule, recipe, scales), log, journal, first_only=not last)
        if not found.lost:
            break
        lower.append({"key_bits": floor, **found.passkey["rejected"][0]})
    if lower and found.passkey is not None:
        found = found._replace(passkey={**found.passkey, "lower_key_bits": lower})
    return found


def _search(inputs: ExportInputs, fmt: CacheFormat, net: nn.Module, bases: list[LayerBasis], scoring: _Scoring,
            target: Target | None, rule: Rule, log: Log, journal: Journal, first_only: bool = False) -> _Found:
    """Search for the target (or score the one point of a compression target), then keep the chosen point only if
    it retrieves the original's pass keys (plan/longrange.py); with `first_only`, the search's own point alone is
    checked, and a record with it rejected returned if it loses a key. What `journal` holds is not measured
    again."""
    recipe = inputs.recipe
    evaluator, baseline = scoring
    base = evaluator.baseline
    if target is None:
        best, curve = for_compression(fmt, bases, evaluator, recipe.ratio, rule)
        return _Found(best, tuple(curve), baseline, None, net, rule)
    log(f"searching for {target.describe()}")
    started = [time.monotonic()]

    def scored(p: Point) -> None:  # one line per candidate, with what it took
        log(f"candidate {p.describe(recipe.eval_text)} ({time.monotonic() - started[0]:.0f} s)")
        started[0] = time.monotonic()

    def remember(score):
        return journal.scorer(score, base)

    best, curve = fmt.search(bases, evaluator, target, rule, steps=recipe.search_steps, progress=scored,
                             remember=remember)
    if not recipe.passkey:
        return _Found(best, tuple(curve), baseline, None, net, rule)
    # Checked on the search's model, in the dtype sources.models.run_dtype chose, which verify's `auto` chooses
    # too: a key at the edge can flip between dtypes (measured: a bfloat16 search's check kept 10/10, float32 lost
    # one), so the check and verify run in one dtype; no second model is read.
    like = next(net.parameters())

    def patches_for(p: Point) -> list[dict]:
        return fmt.passkey_patches(bases, evaluator, rule(p.r_k, p.r_v), like)

    def between(a: Point, b: Point) -> Point:  # scored as the search scores
        started[0] = time.monotonic()  # its own time, not the pass-key checks before it
        point = fmt.measure(bases, evaluator, rule(math.sqrt(a.r_k * b.r_k), math.sqrt(a.r_v * b.r_v)), remember)
        scored(point)
        return point

    def answers(key: str, run):  # the same knob at another key floor is another cache
        return journal.answers(key if key == "original" else f"key_bits {recipe.key_bits} {key}", run)

    try:
        kept, record, checked = _keep_passkeys(net, inputs.ref, recipe.passkey, [best] if first_only else curve,
                                               target, patches_for, log, None if first_only else between, answers)
    except PasskeysLost as lost:
        if not first_only:
            raise
        return _Found(best, tuple(curve), baseline, lost.record, net, rule, lost=True)  # searched again
    return _Found(kept, tuple(curve if first_only else checked), baseline, record, net, rule)


def _reload_for_bake(net: nn.Module, ref: ModelRef, device: str) -> tuple[str, str] | None:
    """What is baked and written: `net` itself (None), or the model read again, in the (dtype, device) returned:
    in the source checkpoint's dtype when the search ran in another. A model placed by accelerate (--device-map)
    is read again whole on the CPU: baking reads and replaces weights that its offloaded layers do not hold
    outside their forward passes. The caller frees `net` before reading it again (issue 52)."""
    stored = source_dtype(ref)
    if len(set((getattr(net, "hf_device_map", None) or {}).values())) > 1:
        return stored, "cpu"
    if next(net.parameters()).dtype == DTYPES[stored]:
        return None
    return stored, device


def _keep_passkeys(net: nn.Module, ref: ModelRef, context: int, curve: list[Point], target: Target, patches_for,
                   log: Log, between, remember) -> tuple[Point, dict, list[Point]]:
    """plan/longrange.py on prompts of `context` tokens, or the model's whole context if shorter; skipped, and
    recorded as such, where that has no room for the task. Points scored on the way join the curve returned."""
    try:
        prompts = passkey_prompts(load_tokenizer(ref.path), passkey_length(net, context))
    except KVFoldError as e:
        log(f"pass keys not checked: {e}")
        return best_point(curve, target), {"skipped": str(e)}, curve
    log(f"pass keys at {len(prompts[0].ids)} tokens: the most compressed passing point that keeps the original's")
    best, record, added = keep_passkeys(net, ref.adapter, prompts, curve, target, patches_for, log, between, remember)
    return best, record, sorted([*curve, *added], key=lambda p: (p.r_k, p.r_v))
