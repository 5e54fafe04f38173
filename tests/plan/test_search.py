import pytest

from kvfold.errors import KVFoldError
from kvfold.plan.evaluate import Metrics
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
    plain, _ = search_rate(_plan, _smooth, 0.99, "top1", lambda r: RankRule(r, r))
    safe, _ = search_rate(_plan, _smooth, 0.99, "top1", lambda r: RankRule(r, r), margin=2.0)
    assert safe.top1_se > 0 and safe.compression < plain.compression
    assert safe.top1_ratio - 2.0 * safe.top1_se >= 0.99


def test_search_finds_the_largest_compression_meeting_the_target():
    best, curve = search_rate(_plan, _score(0.2), 0.99, "top1", lambda r: RankRule(r, r))
    assert best.top1_ratio >= 0.99 and 0.17 < best.compression <= 0.2
    assert max(p.compression for p in curve if p.top1_ratio >= 0.99) == best.compression
    assert [p.r_k for p in curve] == sorted(p.r_k for p in curve)


def test_unreachable_target_says_the_best_reachable():
    with pytest.raises(KVFoldError, match=r"not reachable.*best reachable is 0\.9000"):
        search_rate(_plan, _score(-1.0), 0.99, "top1", lambda r: RankRule(r, r))
