"""Sweep every method on one model and read off the compression each reaches at the target."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from kvfold.measure.metrics import Metrics
from kvfold.plan.criteria import Target
from kvfold.plan.longrange import NUDGES, Verdict, judge

from .methods import Method
from .setup import Setup

__all__ = ["Point", "at_target", "meets", "read_with_passkeys", "sweep_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    knob: float
    kv_fraction: float  # KV bytes per token / the original's at fp16
    top1_ratio: float
    top1_se: float  # standard errors: paired over the 512-token windows
    ppl_ratio: float  # ppl / ppl₀ (1.0 = the original; higher is worse)
    ppl_se: float = 0.0
    agreement: float = 1.0  # top-1 agreement with the original
    kl: float = 0.0  # mean KL(original ‖ this), nats per token
    kl_p99: float = 0.0
    # Scored on a mixture of texts (the default wiki:eval+pydoc:eval): the same figures on each text alone, in
    # the mixture's order. The target holds only where it holds on the mixture and on every text (as export's).
    parts: tuple[Point, ...] = ()
    kv_fraction_32k: float | None = None  # the same bytes at 32K tokens, where they depend on the context

    @classmethod
    def measured(cls, knob: float, kv_fraction: float, m: Metrics, b: Metrics) -> Point:
        parts = tuple(cls.measured(knob, kv_fraction, m.part(i), b.part(i)) for i in m.parts)
        return cls(knob, kv_fraction, m.ratio(b, "top1"), m.top1_ratio_se(b), m.ratio(b, "ppl"), m.ppl_ratio_se(b),
                   m.agreement, m.kl, m.kl_p99, parts)


ORIGINAL = Point(0.0, 1.0, 1.0, 0.0, 1.0)


def slack(p: Point, target: float, joint: bool) -> tuple[float, ...]:
    """Per bound of the export's target (plan/criteria.py: top-1 ratio ≥ target and, joint, perplexity ratio
    ≤ 1/target) on the mixture and on each of its texts, ≥ 0 when met. Point estimates, margin 0: the frontier
    compares methods, it does not promise a deployment."""
    return tuple(b.slack(q, 0.0) for q in (p, *p.parts) for b in Target("joint" if joint else "top1", target).bounds)


def meets(p: Point, target: float, joint: bool = True) -> bool:
    return min(slack(p, target, joint)) >= 0


def at_target(points: list[Point], target: float, origin: Point | None, joint: bool = False) -> float | None:
    """The smallest KV fraction the method keeps `target` at: walk the sweep from its mildest point
    (the origin: the original, or e.g. fp8 alone for kvfold+fp8) and interpolate linearly to the first
    point that fails a bound (the bound that fails first between the two). None when the origin itself
    fails. A one-point method (fp8) has nothing in between: its point if it passes, else no compression."""
    prev = origin or ORIGINAL
    if min(slack(prev, target, joint)) < 0:
        return None
    if len(points) == 1 and origin is None:
        return points[0].kv_fraction if min(slack(points[0], target, joint)) >= 0 else 1.0
    for p in sorted(points, key=lambda p: -p.kv_fraction):
        if len(prev.parts) != len(p.parts):  # the original scores 1.0 on every text of the mixture too
            prev = replace(prev, parts=(replace(prev, parts=()),) * len(p.parts))
        if min(slack(p, target, joint)) < 0:
            t = min(a / (a - b) for a, b in zip(slack(prev, target, joint), slack(p, target, joint), strict=True)
                    if b < 0)
            return prev.kv_fraction + t * (p.kv_fraction - prev.kv_fraction)
        prev = p
    return prev.kv_fraction  # never fell under: at least this much (the JSON says so)


def _run(method: Method, setup: Setup) -> tuple[list[Point], list]:
    points, cands = [], []
    for cand in method.candidates(setup):
        cands.append(cand)
        t0 = time.perf_counter()
        points.append(replace(Point.measured(cand.knob, cand.kv_fraction, setup.score(cand.patches, cand.proj_maps),
                                             setup.baseline), kv_fraction_32k=cand.kv_fraction_32k))
        log.info("%s %s: %s=%g  KV %.4f of fp16  top-1 ratio %.4f ± %.4f  ppl ratio %.4f  KL %.5f  (%.0f s)",
                 setup.spec, method.name, method.knob, cand.knob, cand.kv_fraction, points[-1].top1_ratio,
                 points[-1].top1_se, points[-1].ppl_ratio, points[-1].kl, time.perf_counter() - t0)
    return points, cands


# At most this many points checked per method, from the smallest up: a check is up to three 4K passes (minutes on a CPU)
MAX_CHECKS = 4


def read_with_passkeys(points: list[Point], target: float, check: Callable[[int], Verdict],
                       max_checks: int = MAX_CHECKS) -> tuple[float | None, list[dict]]:
    """The smallest measured KV fraction that meets the joint target on every text and keeps the pass keys by
    export's rule (plan/longrange.judge: every key the original retrieves, under each rounding, by a mean margin
    of Z spreads): the passing points from the smallest up, `check(i)` judging point i, at most `max_checks` of
    them. A measured point, not interpolated: a count of keys has no line between two points. None when no point
    checked keeps them; with each point checked."""
    passing = sorted((i for i, p in enumerate(points) if meets(p, target)), key=lambda i: points[i].kv_fraction)
    checked = []
    for i in passing[:max_checks]:
        verdict = check(i)
        checked.append({"kv_fraction": points[i].kv_fraction, "kept": verdict.kept, "retrieved": verdict.counts,
                        **verdict.margin})
        if verdict.kept:
            return points[i].kv_fraction, checked
    return None, checked


def _passkey(setup: Setup, method: str, points: list[Point], cands: list, target: float) -> dict:
    """With --passkey: the method read as export reads its own (read_with_passkeys), each point under as many
    roundings as export draws (plan/longrange.NUDGES, here as patches.nudged: drawn the same way for every
    method; a cache that does not round gets three alike answers and no spread), and the keys retrieved at the
    smallest passing point with the answers' NLL against the original's (setup.passkey_summary)."""
    if not setup.passkey:
        return {}
    original = setup.passkey_original()
    first: dict = {}

    def check(i: int) -> Verdict:
        def draws():
            for nudge in NUDGES:
                got = setup.passkey_answers(cands[i].patches, cands[i].proj_maps, nudge)
                if not first:  # the smallest passing point's first rounding: its keys and NLL in the JSON
                    first["summary"] = {"kv_fraction": points[i].kv_fraction, **setup.passkey_summary(got)}
                yield got

        verdict = judge(original, draws())
        log.info("%s: pass keys at KV %.4f of fp16: %s of %d (each rounding), closest key's mean margin %+.3f, "
                 "spread %.3f: %s", method, points[i].kv_fraction, "/".join(map(str, verdict.counts)),
                 len(original.hits), verdict.margin["mean"], verdict.margin["spread"],
                 "kept" if verdict.kept else "rejected")
        return verdict

    kept, checked = read_with_passkeys(points, target, check)
    return {"passkey_at_best_passing": first.get("summary"),
            "kv_fraction_at_joint_target_with_passkeys": kept, "passkey_checks": checked}


def sweep_model(setup: Setup, methods: list[Method], target: float) -> list[dict]:
    done: dict[str, list[Point]] = {}
    rows = []
    for method in methods:  # a method that cannot run on this model says so before any work
        if hasattr(method, "check"):
            method.check(setup.adapter)
    for method in methods:
        t0 = time.perf_counter()
        points, cands = _run(method, setup)
        done[method.name] = points
        origin = None
        if method.origin is not None:
            if method.origin not in done:
                raise AssertionError(f"{method.name} needs {method.origin} first")  # order fixed by the runner
            origin = done[method.origin][0]
        kv = at_target(points, target, origin)
        kv_joint = at_target(points, target, origin, joint=True)
        passing = [p for p in points if meets(p, target)]
        rows.append({
            "name": method.name, "label": method.label, "knob": method.knob, "origin": method.origin,
            "kv_fraction_at_target": None if kv is None else round(kv, 4),
            "compression_at_target": None if kv is None else round(1 - kv, 4),
            # the same under the joint target (top-1 ratio ≥ A and perplexity ratio ≤ 1/A), kvfold's default
            "kv_fraction_at_joint_target": None if kv_joint is None else round(kv_joint, 4),
            "compression_at_joint_target": None if kv_joint is None else round(1 - kv_joint, 4),
            "every_point_passes": len(passing) == len(points),  # the joint target, every text
            "best_measured_passing": None if not passing else asdict(min(passing, key=lambda p: p.kv_fraction)),
            "points": [asdict(p) for p in points],
            **_passkey(setup, method.name, points, cands, target),
            "seconds": round(time.perf_counter() - t0, 1),
        })
    return rows
