"""The search's long-context guard: the chosen point must retrieve as many pass keys as the original.

The accuracy search scores 512-token windows, which say little about a cache read thousands of tokens
later. Measured on SmolLM2-135M (2026-11-25, README "Long context"): the default 0.99 export met its
target on every 512-token text and retrieved 6 of 10 pass keys at 4,096 tokens where the original
retrieves 10; with one rate for every head (eq6), 8 of 10. So after the search, the passing points are
tried from the most compressed down, each on the passkey prompts (plan/passkey.py), and the first that
retrieves at least as many keys as the original is chosen. A check per point tried (10 prompts of
`context` tokens), not per candidate: the search itself stays as cheap as before.

A quantized cache (the bits format) is checked under several roundings of the same cache (plan/stored.banded's
nudge) and counts the fewest keys any of them retrieves: SmolLM2's own answers win by 0.26–1.4 nats, and
code flips from float round-off move a bits export's margins by up to 0.3, so one rounding's 10/10 was
measured to become 8/10 in the served checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from kvfold.adapters import Adapter
from kvfold.calib.capture import AttentionPatch, patched
from kvfold.errors import KVFoldError
from kvfold.plan.criteria import Target
from kvfold.plan.passkey import PasskeyPrompt, passkey_hits
from kvfold.plan.search import CurvePoint

__all__ = ["NUDGES", "keep_passkeys"]

NUDGES = (0.0, 1e-6, -1e-6)  # a quantized cache's roundings the check runs (plan/stored.banded)


def keep_passkeys(model: nn.Module, adapter: Adapter, prompts: list[PasskeyPrompt], curve: list[CurvePoint],
                  target: Target, patches_for: Callable[[CurvePoint], list[dict[int, AttentionPatch]]],
                  log: Callable[[str], None] = lambda line: None) -> tuple[CurvePoint, dict]:
    """The most compressed point of `curve` that meets `target` and retrieves as many keys as `model`
    itself under every patch set `patches_for` gives for it (one per rounding of its cache), and a record of
    the check for the manifest (the points rejected on the way, with the fewest keys a rounding retrieved)."""
    want = sum(passkey_hits(model, prompts))
    record = {"context": len(prompts[0].ids), "prompts": len(prompts), "original": want, "rejected": []}
    seen: set[float] = set()
    passing = sorted((p for p in curve if target.met(p)), key=lambda p: (-p.compression, -target.slack(p)))
    for point in passing:
        if point.compression in seen:
            continue
        seen.add(point.compression)
        counts = []
        for patches in patches_for(point) if point.compression > 0 else [{}]:
            with patched(model, adapter, patches):
                counts.append(sum(passkey_hits(model, prompts)))
            if counts[-1] < want:  # this point is out: the other roundings cannot bring it back
                break
        got = min(counts)
        log(f"pass keys at p={point.compression:.4f}: {'/'.join(map(str, counts))} of {len(prompts)} at "
            f"{record['context']} tokens{' (each rounding)' if len(counts) > 1 else ''} (original {want})")
        record["roundings"] = max(record.get("roundings", 1), len(counts))
        if got >= want:
            return point, {**record, "retrieved": got, "compression": point.compression}
        record["rejected"].append({"compression": point.compression, "retrieved": got})
    best = max(record["rejected"], key=lambda r: r["retrieved"])
    raise KVFoldError(f"no compression that meets the target keeps the pass keys at {record['context']} tokens (the "
                      f"best retrieves {best['retrieved']}/{len(prompts)}, the original {want}); ask for a higher "
                      "accuracy, or pass --passkey 0 if the model will only serve short contexts")
