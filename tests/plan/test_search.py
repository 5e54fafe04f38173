import json
import math

import pytest
from pydantic import TypeAdapter

from kvfold.errors import KVFoldError
from kvfold.measure.metrics import Metrics
from kvfold.plan.criteria import Target
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankPlan, RankRule
from kvfold.plan.search import search_rate

BASE = Metrics(top1=0.5, nll=2.0, tokens=100)


def _plan(rr: RankRule) -> RankPlan:
    keep = max(0, 64 - int(rr.r_k * 128))  # ranks fall as r grows
    return RankPlan(d_k=[[keep]], d_v=[[64]], head_dim=64)


def _score(edge: float):
    def score(ranks: RankPlan):
        p = ranks.compression
        return Metrics(top1=0.5 * (1.0 if p <= edge else 0.9), nll=2.0 + p, tokens=100), BASE

    return score


def _smooth(ranks: RankPlan):
    """top-1 ratio 1 − p/10 with per-window noise, so the standard error is > 0."""
    ratio = 1.0 - ranks.compression / 10
    hits = (round(500 * ratio) + 1, round(500 * ratio) - 1)
    base = Metrics(top1=0.5, nll=2.0, tokens=2000, correct=(500, 500))
    return Metrics(top1=sum(hits) / 2000, nll=2.0, tokens=2000, correct=hits), base


def test_margin_picks_a_safer_point():
    plain, _ = search_rate(_plan, _smooth, Target("top1", 0.99), lambda r: RankRule(r, r))
    safe, _ = search_rate(_plan, _smooth, Target("top1", 0.99, margin=2.0), lambda r: RankRule(r, r))
    assert safe.top1_se > 0 and safe.compression < plain.compression
    assert safe.top1_ratio - 2.0 * safe.top1_se >= 0.99


def test_a_figure_without_standard_error_is_held_to_the_limit_itself():
    """One 512-token window gives no standard error: verify's held-out allowance (margin −2) and a margin alike
    then read the figure as it is, not as nan (which would fail every bound)."""
    one_window = Point(1.0, 1.0, 0.5, 0.95, 1.05, math.nan, math.nan)
    assert Target("joint", 0.9).met(one_window, margin=-2.0) and Target("joint", 0.9).met(one_window, margin=1.0)
    assert not Target("joint", 0.96).met(one_window, margin=-2.0)


def test_search_finds_the_largest_compression_meeting_the_target():
    best, curve = search_rate(_plan, _score(0.2), Target("top1", 0.99), lambda r: RankRule(r, r))
    assert best.top1_ratio >= 0.99 and 0.17 < best.compression <= 0.2
    assert max(p.compression for p in curve if p.top1_ratio >= 0.99) == best.compression
    assert [p.r_k for p in curve] == sorted(p.r_k for p in curve)


def test_fewer_steps_score_fewer_candidates_and_never_a_stronger_point():
    """--search-steps: the mildest point, then one candidate per step (the strongest rate only if every step met
    the target); a coarser search keeps a point at most as compressed, still meeting the target."""
    calls = {}

    def counting(steps):
        def score(ranks):
            calls[steps] = calls.get(steps, 0) + 1
            return _score(0.2)(ranks)
        return score

    fine, _ = search_rate(_plan, counting(8), Target("top1", 0.99), lambda r: RankRule(r, r), steps=8)
    coarse, curve = search_rate(_plan, counting(2), Target("top1", 0.99), lambda r: RankRule(r, r), steps=2)
    assert len(curve) <= 4 and calls[2] <= 4 < calls[8]
    assert coarse.top1_ratio >= 0.99 and coarse.compression <= fine.compression


def test_unreachable_target_says_the_best_reachable():
    with pytest.raises(KVFoldError, match=r"not reachable.*top-1 ratio 0\.9000"):
        search_rate(_plan, _score(-1.0), Target("top1", 0.99), lambda r: RankRule(r, r))


def _drifting(ranks: RankPlan):
    """Top-1 ratio stays 1 while perplexity grows 10% per 0.1 of compression: the case top-1 alone misses."""
    p = ranks.compression
    base = Metrics(top1=0.5, nll=2.0, tokens=100)
    return Metrics(top1=0.5, nll=2.0 + p, tokens=100), base


def test_the_joint_target_stops_where_perplexity_drifts_and_top1_does_not():
    top1, _ = search_rate(_plan, _drifting, Target("top1", 0.99), lambda r: RankRule(r, r))
    joint, _ = search_rate(_plan, _drifting, Target("joint", 0.99), lambda r: RankRule(r, r))
    assert top1.compression == 0.5 and top1.ppl_ratio > 1.5  # top-1 never falls: the mildest-to-strongest edge
    assert joint.ppl_ratio <= 1 / 0.99 and joint.compression < 0.02


def test_each_metric_bounds_its_own_figure():
    p = Point(0, 0, 0.1, top1_ratio=0.995, ppl_ratio=1.02, top1_se=0.002, ppl_se=0.005, agreement=0.97,
              agreement_se=0.01, kl=0.02, kl_se=0.001)
    assert Target("top1", 0.99).met(p) and not Target("top1", 0.99, margin=3).met(p)
    assert not Target("joint", 0.99).met(p) and Target("joint", 0.99).met(p, margin=-2)  # 1.02 − 2·0.005 ≤ 1.0101
    assert Target("ppl", 0.98).met(p) and not Target("agree", 0.98).met(p) and Target("agree", 0.98).met(p, -1)
    assert Target("kl", 0.025).met(p) and not Target("kl", 0.02, margin=1).met(p)
    assert Target("joint", 0.99, 1).describe() == "top-1 ratio ≥ 0.99 and perplexity ratio ≤ 1.0101 (1 se)"


def test_on_a_mixture_the_target_holds_on_each_text_not_only_on_the_pool():
    """Four windows, texts 0 and 1 alternating: text 1's perplexity drifts, text 0's does not. Pooled the
    ratio passes; text 1 alone fails, so the point does not meet the target. The point, parts and all, reads back
    from the manifest's JSON form as it was."""
    base = Metrics(top1=0.5, nll=2.0, tokens=400, correct=(50,) * 4, window_tokens=(100,) * 4,
                   window_nll=(200.0,) * 4, window_part=(0, 1, 0, 1))
    cand = Metrics(top1=0.5, nll=2.008, tokens=400, correct=(50,) * 4, window_tokens=(100,) * 4,
                   window_nll=(200.0, 201.5, 200.0, 201.7), window_part=(0, 1, 0, 1))
    assert cand.parts == [0, 1] and cand.part(1).tokens == 200 and cand.part(1).nll == pytest.approx(2.016)
    point = Point.measured(0.1, 0.1, 0.2, cand, base)
    assert [q.ppl_ratio for q in point.parts] == pytest.approx([1.0, math.exp(0.016)])
    assert point.ppl_ratio < 1 / 0.99 < point.parts[1].ppl_ratio
    assert not Target("joint", 0.99).met(point) and Target("joint", 0.99).met(point.parts[0])
    as_json = TypeAdapter(Point)
    restored = as_json.validate_python(json.loads(json.dumps(as_json.dump_python(point))))
    assert isinstance(restored.parts[1], Point) and repr(restored) == repr(point)  # repr: NaN reads back as NaN
