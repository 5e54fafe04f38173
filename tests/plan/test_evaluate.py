import math

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.calib.tokens import random_sequences
from kvfold.plan.evaluate import Evaluator, Metrics
from kvfold.rewrite.factors import get_method
from kvfold.rewrite.weights import o_proj_heads
from tests.conftest import VOCAB, build_tiny
from tests.rewrite.test_factors import tiny_stats


def test_full_rank_candidate_scores_exactly_the_baseline():
    arch = "Qwen3ForCausalLM"
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    stats = tiny_stats(model, arch)
    d = layout.head_dim
    factors = [get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i))
               .truncate([d] * layout.num_kv_heads, [d] * layout.num_kv_heads) for i in range(layout.num_layers)]
    ev = Evaluator(model, adapter, random_sequences(VOCAB, 256, 64, seed=1), batch=2)
    full = ev.score(factors)
    assert full.correct == ev.baseline.correct and math.isclose(full.nll, ev.baseline.nll, rel_tol=1e-5)
    small = ev.score([get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i)).truncate([4, 4], [4, 4])
                      for i in range(layout.num_layers)])
    assert small.nll > full.nll
    assert len(full.correct) == 4 and sum(full.correct) == round(full.top1 * full.tokens)


def test_paired_standard_error():
    base = Metrics(top1=0.5, nll=1.0, tokens=400, correct=(50, 50, 50, 50))
    same = Metrics(top1=0.5, nll=1.0, tokens=400, correct=(50, 50, 50, 50))
    assert same.top1_ratio_se(base) == 0.0
    cand = Metrics(top1=0.49, nll=1.0, tokens=400, correct=(48, 50, 50, 48))
    r = 196 / 200
    want = math.sqrt(4 / 3 * sum((c - r * 50) ** 2 for c in cand.correct)) / 200
    assert math.isclose(cand.top1_ratio_se(base), want)
