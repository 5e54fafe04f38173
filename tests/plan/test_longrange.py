"""The export's long-context guard (plan/longrange.py): the most compressed passing point that keeps the
original's pass keys under every rounding of its cache."""

import pytest
import torch

from kvfold.adapters import get_adapter
from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch, patched
from kvfold.measure.passkey import PasskeyPrompt, passkey_prompts
from kvfold.plan.criteria import Target
from kvfold.plan.longrange import keep_passkeys
from kvfold.plan.point import Point
from tests.conftest import build_tiny, tiny_tokenizer

ARCH = "LlamaForCausalLM"


def _answered(model, prompts):
    """The prompts with the model's own greedy answers: the original retrieves every key."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            question = p.ids[: -p.answer]
            greedy = model.generate(question[None], max_new_tokens=p.answer, min_new_tokens=p.answer,
                                    do_sample=False)[0, len(question):]
            out.append(PasskeyPrompt(torch.cat([question, greedy]), p.answer, p.depth, p.key))
    return out


def _point(p: float) -> Point:
    return Point(0, 0, p, top1_ratio=1.0, ppl_ratio=1.0, top1_se=0.0, ppl_se=0.0)


def _setup(prompts: int):
    """The tiny model, its adapter, `prompts` passkey prompts it answers, and patches that lose its keys
    (every layer's values zeroed)."""
    model, adapter = build_tiny(ARCH), get_adapter(ARCH)
    layers = len(adapter.attention_modules(model))
    broken = {i: AttentionPatch(before=lambda q, k, v: (q, k, torch.zeros_like(v))) for i in range(layers)}
    return model, adapter, _answered(model, passkey_prompts(tiny_tokenizer(), 512)[:prompts]), broken


def test_a_point_is_kept_only_if_every_rounding_keeps_the_keys():
    model, adapter, prompts, broken = _setup(4)
    seen = []

    def patches_for(point):  # the most compressed point loses the keys in its second rounding only
        seen.append(point.compression)
        return [{}, broken, {}] if point.compression == 0.5 else [{}, {}, {}]

    curve = [_point(0.2), _point(0.5), _point(0.3)]
    best, record, added = keep_passkeys(model, adapter, prompts, curve, Target("top1", 0.99), patches_for)
    assert best.compression == 0.3 and seen == [0.3, 0.5] and added == []  # bisected: the middle first
    assert record["original"] == record["retrieved"] == len(prompts) and record["roundings"] == 3
    assert len(record["rejected"]) == 1 and record["rejected"][0]["compression"] == 0.5
    assert record["rejected"][0]["retrieved"] < len(prompts)  # the fewest keys of its roundings
    with pytest.raises(KVFoldError, match="keeps the pass keys"):
        keep_passkeys(model, adapter, prompts, [_point(0.5)], Target("top1", 0.99), lambda p: [broken])


def test_the_passing_points_are_bisected_not_walked_one_by_one():
    """Seven passing points, keys kept at p <= 0.3: found in three checks, and the point chosen is 0.3."""
    model, adapter, prompts, broken = _setup(2)
    seen = []

    def patches_for(point):
        seen.append(point.compression)
        return [{}, {}, {}] if point.compression <= 0.3 else [broken]

    curve = [_point(p) for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)]
    best, record, _ = keep_passkeys(model, adapter, prompts, curve, Target("top1", 0.99), patches_for)
    assert best.compression == 0.3 and seen == [0.4, 0.2, 0.3]
    assert [r["compression"] for r in record["rejected"]] == [0.4]


def test_a_wide_gap_between_kept_and_rejected_is_narrowed_by_points_scored_between():
    """Kept 0.2, rejected 0.5: points between them are scored (`between`) and checked while the two are more
    than REFINE_GAP apart, at most REFINE_STEPS times; keys here survive up to p = 0.4."""
    from kvfold.plan.longrange import REFINE_STEPS

    model, adapter, prompts, broken = _setup(2)
    scored = []

    def between(a, b):
        scored.append((a.compression, b.compression))
        return _point((a.compression + b.compression) / 2)

    best, record, added = keep_passkeys(model, adapter, prompts, [_point(0.2), _point(0.5)], Target("top1", 0.99),
                                        lambda p: [broken] if p.compression > 0.4 else [{}], between=between)
    assert scored == [(0.2, 0.5), (0.35, 0.5), (0.35, 0.425)][:REFINE_STEPS]
    assert [p.compression for p in added] == pytest.approx([0.35, 0.425, 0.3875])
    assert best.compression == pytest.approx(0.3875) and record["refined"] == 3
    assert record["compression"] == best.compression
    assert [r["compression"] for r in record["rejected"]] == [0.5, 0.425]
    # without `between` (or with the two close enough) the first kept point stands
    best, record, added = keep_passkeys(model, adapter, prompts, [_point(0.2), _point(0.5)], Target("top1", 0.99),
                                        lambda p: [broken] if p.compression > 0.4 else [{}])
    assert best.compression == 0.2 and added == [] and "refined" not in record


def test_a_key_whose_margin_is_within_the_roundings_spread_is_not_kept():
    """Every key retrieved under every rounding is not enough: each key's mean margin over the roundings must be
    Z spreads (pooled over the prompts) above zero. Two roundings, one exact and one with the values scaled: by
    0.98 the four keys are all kept, the closest by ~0.004 nats against a spread of ~0.01; by 0.995 the closest
    mean margin is ~0.019 against a spread of ~0.002."""
    from kvfold.measure.passkey import passkey_answers
    from kvfold.plan.longrange import Z

    model, adapter, prompts, _ = _setup(4)
    layers = len(adapter.attention_modules(model))

    def shrunk(a):
        return {i: AttentionPatch(before=lambda q, k, v: (q, k, v * a)) for i in range(layers)}

    def summary(a):  # the closest key's mean margin over the two roundings, and their pooled spread
        with patched(model, adapter, shrunk(a)):
            scaled = passkey_answers(model, prompts).margins
        assert all(m > 0 for m in scaled)  # every key kept: the case this test is about
        means = [(x + y) / 2 for x, y in zip(original.margins, scaled, strict=True)]
        spread = (sum((x - y) ** 2 / 2 for x, y in zip(original.margins, scaled, strict=True)) / len(means)) ** 0.5
        return min(means), spread

    original = passkey_answers(model, prompts)
    (close, close_spread), (clear, clear_spread) = summary(0.98), summary(0.995)
    assert close < Z * close_spread and clear >= Z * clear_spread

    best, record, _ = keep_passkeys(model, adapter, prompts, [_point(0.3), _point(0.5)], Target("top1", 0.99),
                                    lambda p: [{}, shrunk(0.98 if p.compression == 0.5 else 0.995)])
    assert best.compression == 0.3 and record["z"] == Z and record["retrieved"] == 4
    assert record["rejected"] == [{"compression": 0.5, "retrieved": 4, "mean": pytest.approx(close, abs=1e-4),
                                   "spread": pytest.approx(close_spread, abs=1e-4)}]
    assert (record["mean"], record["spread"]) == (pytest.approx(clear, abs=1e-4), pytest.approx(clear_spread, abs=1e-4))


def test_an_original_that_retrieves_no_key_keeps_every_point():
    """Nothing to lose: the tiny model does not retrieve the standard prompts' keys, so the most compressed
    passing point is kept, under any rounding."""
    model, adapter, _, broken = _setup(1)
    prompts = passkey_prompts(tiny_tokenizer(), 512)[:2]
    best, record, _ = keep_passkeys(model, adapter, prompts, [_point(0.2), _point(0.5)], Target("top1", 0.99),
                                    lambda p: [{}, broken])
    assert best.compression == 0.5 and record["original"] == record["retrieved"] == 0 and record["rejected"] == []


def test_a_reused_curve_skips_points_more_compressed_than_one_that_lost_keys():
    """--reuse-curve (plan/reuse.pick): the check bisected from the most compressed down, so points past the first
    rejected one were never checked and count as lost; the previous choice comes back with its record."""
    from kvfold.plan.recipe import Recipe
    from kvfold.plan.reuse import pick

    curve = tuple(_point(p) for p in (0.2, 0.3, 0.4, 0.5, 0.6))
    record = {"compression": 0.3, "rejected": [{"compression": 0.4}]}
    best, kept = pick(curve, Recipe(accuracy=0.99), Target("joint", 0.99), record)
    assert best.compression == 0.3 and kept is record
    best, kept = pick(curve, Recipe(accuracy=0.99), Target("joint", 0.99), None)  # no pass-key check recorded
    assert best.compression == 0.6 and kept is None
