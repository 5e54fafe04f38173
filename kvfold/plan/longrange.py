"""The search's long-context guard: the chosen point must retrieve as many pass keys as the original.

The accuracy search scores 512-token windows, which say little about a cache read thousands of tokens
later. Measured on SmolLM2-135M (2026-11-25, README "Long context"): the default 0.99 export met its
target on every 512-token text and retrieved 6 of 10 pass keys at 4,096 tokens where the original
retrieves 10; with one rate for every head (eq6), 8 of 10. So after the search, the passing points are
tried from the most compressed down, each on the passkey prompts (measure/passkey.py), and the first that
retrieves at least as many keys as the original is chosen. A check per point tried (10 prompts of
`context` tokens), not per candidate: the search itself stays as cheap as before.

The search spends its candidates near the accuracy boundary, so the first point kept can sit far below the
last one rejected (a bits export: 0.613 kept, 0.667 rejected, 16% of the cache apart). While the two are
more than REFINE_GAP apart, the knob halfway between them (geometrically) is scored like a search candidate
(`between`) and checked, up to REFINE_STEPS times; the new points join the curve.

A quantized cache (the bits format) is checked under several roundings of the same cache (plan/stored.banded's
nudge) and counts the fewest keys any of them retrieves: SmolLM2's own answers win by 0.26–1.4 nats, and
code flips from float round-off move a bits export's margins by up to 0.3, so one rounding's 10/10 was
measured to become 8/10 in the served checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvfold.adapters import Adapter
from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch, patched
from kvfold.measure.passkey import PasskeyPrompt, passkey_hits
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point

__all__ = ["NUDGES", "keep_passkeys"]

NUDGES = (0.0, 1e-6, -1e-6)  # a quantized cache's roundings the check runs (plan/stored.banded)
REFINE_GAP = 0.01  # compression p between the point kept and the next rejected one worth a point between them
REFINE_STEPS = 3


def keep_passkeys(model: nn.Module, adapter: Adapter, prompts: list[PasskeyPrompt], curve: list[Point],
                  target: Target, patches_for: Callable[[Point], list[dict[int, AttentionPatch]]],
                  log: Callable[[str], None] = lambda line: None,
                  between: Callable[[Point, Point], Point] | None = None
                  ) -> tuple[Point, dict, list[Point]]:
    """The most compressed point of `curve` that meets `target` and retrieves as many keys as `model`
    itself under every patch set `patches_for` gives for it (one per rounding of its cache); a record of
    the check for the manifest (the points rejected on the way, with the fewest keys a rounding retrieved);
    and the points `between` scored to narrow the gap to the next rejected one (module docstring)."""
    want = sum(passkey_hits(model, prompts))
    record = {"context": len(prompts[0].ids), "prompts": len(prompts), "original": want, "rejected": []}

    retrieved: dict[float, int] = {}  # compression -> the fewest keys its roundings retrieved

    def keeps(point: Point) -> bool:
        counts = []
        for patches in patches_for(point) if point.compression > 0 else [{}]:
            with patched(model, adapter, patches):
                counts.append(sum(passkey_hits(model, prompts)))
            if counts[-1] < want:  # this point is out: the other roundings cannot bring it back
                break
        retrieved[point.compression] = got = min(counts)
        log(f"pass keys at p={point.compression:.4f}: {'/'.join(map(str, counts))} of {len(prompts)} at "
            f"{record['context']} tokens{' (each rounding)' if len(counts) > 1 else ''} (original {want})")
        record["roundings"] = max(record.get("roundings", 1), len(counts))
        if got < want:
            record["rejected"].append({"compression": point.compression, "retrieved": got})
        return got >= want

    passing = sorted((p for p in curve if target.met(p)), key=lambda p: (-p.compression, -target.slack(p)))
    rejected: Point | None = None
    for point in passing:
        if point.compression in retrieved:
            continue
        if keeps(point):
            added: list[Point] = []
            if rejected is not None:
                point, added = _narrow(point, rejected, target, keeps, between, log)
            return point, {**record, "retrieved": retrieved[point.compression], "compression": point.compression,
                           **({"refined": len(added)} if added else {})}, added
        rejected = point
    best = max(record["rejected"], key=lambda r: r["retrieved"])
    raise KVFoldError(f"no compression that meets the target keeps the pass keys at {record['context']} tokens (the "
                      f"best retrieves {best['retrieved']}/{len(prompts)}, the original {want}); ask for a higher "
                      "accuracy, or pass --passkey 0 if the model will only serve short contexts")


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
