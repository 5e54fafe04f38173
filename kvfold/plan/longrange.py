"""The search's long-context guard: the chosen point must retrieve as many pass keys as the original.

The accuracy search scores 512-token windows, which say little about a cache read thousands of tokens
later. Measured on SmolLM2-135M (2026-11-25, README "Long context"): the default 0.99 export met its
target on every 512-token text and retrieved 6 of 10 pass keys at 4,096 tokens where the original
retrieves 10; with one rate for every head (eq6), 8 of 10. So after the search, the passing points are
checked on the passkey prompts (measure/passkey.py), bisected from the most compressed down, and the most
compressed one found that retrieves at least as many keys as the original is chosen. A check per point tried
(10 prompts of `context` tokens), not per candidate: the search itself stays as cheap as before.

The search spends its candidates near the accuracy boundary, so the first point kept can sit far below the
last one rejected (a bits export: 0.613 kept, 0.667 rejected, 16% of the cache apart). While the two are
more than REFINE_GAP apart, the knob halfway between them (geometrically) is scored like a search candidate
(`between`) and checked, up to REFINE_STEPS times; the new points join the curve.

A quantized cache (the bits format) is checked under several roundings of the same cache (plan/stored.banded's
nudge) and counts the fewest keys any of them retrieves: SmolLM2's own answers win by 0.26–1.4 nats, and
code flips from float round-off move a bits export's margins by up to 0.3, so one rounding's 10/10 was
measured to become 8/10 in the served checkpoint.

Counting is not enough either: a key kept by a hair under three roundings is lost by the next. Rounding flips
grow through the layers, so each rounding is in effect a fresh draw of the cache's noise, and the answer's logit
margin over the runner-up moves between draws. Measured on SmolLM2 (2026-11-28, docs/notebook.md): the per-head
bits export at 0.295 of fp16 had, on one prompt, margins +0.35, +0.01, +0.30 under the check's roundings and
+0.11 served; on another +0.43, +0.28, +0.41, then −0.02 served — the key lost in `kvfold verify`. Spread over
draws: 0.14 nats (pooled). So each point's margins are modelled per prompt as mean μ_p plus a spread σ common to
the prompts, estimated from the roundings (pooled over prompts: 2 degrees of freedom each), and a point keeps the
pass keys when every key the original retrieves is retrieved under every rounding and μ_p ≥ Z·σ for each:
a fresh rounding — the served checkpoint's — loses that key with probability ≤ 5% (Gaussian model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from torch import nn

from kvfold.adapters import Adapter
from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch, patched
from kvfold.measure.passkey import Answers, PasskeyPrompt, passkey_answers
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point

__all__ = ["NUDGES", "PasskeysLost", "Verdict", "judge", "keep_passkeys"]

NUDGES = (0.0, 1e-6, -1e-6)  # a quantized cache's roundings the check runs (plan/stored.banded)
Z = 1.645  # a kept key's mean margin is at least Z spreads: ≤ 5% chance a fresh rounding loses it (docstring)
REFINE_GAP = 0.01  # compression p between the point kept and the next rejected one worth a point between them
REFINE_STEPS = 3


class PasskeysLost(KVFoldError):
    """No point that meets the target keeps the pass keys; `record` is the check's (its rejected points)."""

    def __init__(self, message: str, record: dict) -> None:
        super().__init__(message)
        self.record = record


def keep_passkeys(model: nn.Module, adapter: Adapter, prompts: list[PasskeyPrompt], curve: list[Point],
                  target: Target, patches_for: Callable[[Point], list[dict[int, AttentionPatch]]],
                  log: Callable[[str], None] = lambda line: None,
                  between: Callable[[Point, Point], Point] | None = None,
                  remember: Callable[[str, Callable[[], Answers]], Answers] = lambda key, run: run()
                  ) -> tuple[Point, dict, list[Point]]:
    """The most compressed point of `curve` that meets `target` and retrieves every key `model` itself retrieves,
    under every patch set `patches_for` gives for it (one per rounding of its cache), each by a mean margin of
    Z spreads; a record of the check for the manifest (the points rejected on the way, with the fewest keys a
    rounding retrieved and the margin summary); and the points `between` scored to narrow the gap to the next
    rejected one (module docstring). `remember(key, run)` gives run()'s answers, or the ones recorded under `key`
    (plan/journal.py)."""
    original = remember("original", lambda: passkey_answers(model, prompts, "pass keys: the original"))
    want = sum(original.hits)
    record = {"context": len(prompts[0].ids), "prompts": len(prompts), "original": want, "z": Z, "rejected": []}
    # compression -> the fewest keys its roundings retrieved, and the margin summary of the keys the original does
    retrieved: dict[float, tuple[int, dict]] = {}

    def keeps(point: Point) -> bool:
        def answers(i: int, patches: dict[int, AttentionPatch]) -> Answers:
            rounding = f", rounding {i + 1}/{len(roundings)}" if len(roundings) > 1 else ""

            def run() -> Answers:
                with patched(model, adapter, patches):
                    return passkey_answers(model, prompts, f"pass keys at p={point.compression:.4f}{rounding}")
            return remember(f"{point.r_k!r} {point.r_v!r} {i}", run)

        roundings = patches_for(point) if point.compression > 0 else [{}]
        verdict = judge(original, (answers(i, patches) for i, patches in enumerate(roundings)))
        retrieved[point.compression] = verdict.fewest, verdict.margin
        log(f"pass keys at p={point.compression:.4f}: {'/'.join(map(str, verdict.counts))} of {len(prompts)} at "
            f"{record['context']} tokens{' (each rounding)' if len(verdict.counts) > 1 else ''} (original {want}); the "
            f"closest key's mean margin {verdict.margin['mean']:+.3f} nats, spread over roundings "
            f"{verdict.margin['spread']:.3f}")
        record["roundings"] = max(record.get("roundings", 1), len(verdict.counts))
        if not verdict.kept:
            record["rejected"].append({"compression": point.compression, "retrieved": verdict.fewest,
                                       **verdict.margin})
        return verdict.kept

    passing = sorted((p for p in curve if target.met(p)), key=lambda p: (-p.compression, -target.slack(p)))
    passing = [p for i, p in enumerate(passing) if i == 0 or p.compression != passing[i - 1].compression]
    # Bisect the passing points, most compressed first: the first kept one, assuming a point keeps the keys when a
    # more compressed one does. log2 checks instead of one per point: the search crowds its passing points near
    # the accuracy boundary, where the keys are usually lost (a windowed SmolLM2 export: 7 passing points, the
    # 2 most compressed checked lost keys at ~17 min each on a 2-core CPU).
    lo, hi, kept_at = 0, len(passing) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if keeps(passing[mid]):
            kept_at, hi = mid, mid - 1
        else:
            lo = mid + 1
    if kept_at is not None:
        point, added = passing[kept_at], []
        if kept_at > 0:  # the next more compressed point was checked and rejected (the bisection's last step)
            point, added = _narrow(point, passing[kept_at - 1], target, keeps, between, log)
        fewest, margin = retrieved[point.compression]
        return point, {**record, "retrieved": fewest, **margin, "compression": point.compression,
                       **({"refined": len(added)} if added else {})}, added
    best = max(record["rejected"], key=lambda r: (r["retrieved"], r["mean"] - Z * r["spread"]))
    raise PasskeysLost(f"no compression that meets the target keeps the pass keys at {record['context']} tokens (the "
                      f"best retrieves {best['retrieved']}/{len(prompts)}, its closest key by {best['mean']:+.2f} "
                      f"± {best['spread']:.2f} nats over roundings; the original {want}); ask for a higher accuracy, "
                      "or pass --passkey 0 if the model will only serve short contexts", record)


class Verdict(NamedTuple):
    """The pass keys of one cache under its roundings, judged by the rule of the module docstring."""
    kept: bool
    counts: list[int]  # keys retrieved under each rounding tried
    fewest: int
    margin: dict  # the closest key's mean margin over the roundings ("mean") and the pooled spread ("spread")


def _lost_key(original: Answers, got: Answers) -> bool:
    """Whether `got` misses a key the original retrieves: no further rounding can keep that cache."""
    return any(m <= 0 for m, hit in zip(got.margins, original.hits, strict=True) if hit)


def judge(original: Answers, draws: Iterable[Answers]) -> Verdict:
    """`draws`: the cache's answers under each rounding (one for a cache that does not round), read lazily and
    no further than the first that loses a key the original retrieves: no later rounding can bring it back. Kept
    when every key the original retrieves is retrieved under each and its mean margin is at least Z spreads.
    Shared by export's check and the frontier's reading (bench/frontier/sweep.py)."""
    margins, counts, lost = [], [], False
    for got in draws:
        margins.append([m for m, hit in zip(got.margins, original.hits, strict=True) if hit])
        counts.append(sum(got.hits))
        lost = _lost_key(original, got)
        if lost:
            break
    margin = _margin(margins)
    return Verdict(not lost and margin["mean"] >= Z * margin["spread"], counts, min(counts), margin)


def _margin(margins: list[list[float]]) -> dict:
    """Per rounding, the margins of the keys the original retrieves -> the smallest per-prompt mean over the
    roundings (`mean`) and the spread of a rounding's margin about its prompt's mean, pooled over the prompts
    (`spread`; 0 with one rounding: an unquantized cache has no rounding noise)."""
    if not margins[0]:
        return {"mean": 0.0, "spread": 0.0}
    rounds, prompts = len(margins), len(margins[0])
    means = [sum(r[p] for r in margins) / rounds for p in range(prompts)]
    sq = sum((r[p] - means[p]) ** 2 for r in margins for p in range(prompts))
    spread = (sq / (prompts * (rounds - 1))) ** 0.5 if rounds > 1 else 0.0
    return {"mean": round(min(means), 4), "spread": round(spread, 4)}


def _narrow(kept: Point, rejected: Point, target: Target, keeps: Callable[[Point], bool],
            between: Callable[[Point, Point], Point] | None,
            log: Callable[[str], None]) -> tuple[Point, list[Point]]:
    """The most compressed point kept after scoring and checking points between the kept and the rejected
    one while they are far apart, and the points scored."""
    added: list[Point] = []
    for _ in range(REFINE_STEPS if between is not None else 0):
        if rejected.compression - kept.compression <= REFINE_GAP:
            break
        log(f"pass keys: p={kept.compression:.4f} kept, p={rejected.compression:.4f} rejected; scoring a point "
            "between them")
        mid = between(kept, rejected)
        added.append(mid)
        if not kept.compression < mid.compression < rejected.compression:
            break  # the knob has no other plan between them
        if target.met(mid) and keeps(mid):
            kept = mid
        else:
            rejected = mid
    return kept, added
