import math

import pytest
import torch

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.calib.tokens import Sequences, random_sequences
from kvfold.factors import get_method
from kvfold.factors.weights import o_proj_heads
from kvfold.measure.evaluate import TOP_K, Evaluator, Reference, _binned_kl, score_model
from kvfold.measure.metrics import Metrics
from tests.conftest import VOCAB, build_tiny
from tests.factors.test_factors import tiny_stats


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


def test_the_original_against_its_own_reference_agrees_everywhere_with_no_kl():
    model = build_tiny("LlamaForCausalLM")
    windows = random_sequences(VOCAB, 256, 64, seed=2)
    ref = Reference([], [])
    base = score_model(model, windows, batch=2, keep=ref)
    again = score_model(model, windows, batch=2, against=ref)
    assert again.agreement == 1.0 and again.kl == 0.0 and again.kl_p99 == 0.0
    assert again.ppl_ratio_se(base) == 0.0 and again.ratio(base, "ppl") == 1.0
    assert len(ref.top_ids) == 2 and ref.top_ids[0].shape == (2, 63, min(TOP_K, VOCAB))


def test_binned_kl_is_the_full_kl_over_the_whole_vocabulary_and_a_lower_bound_over_fewer():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 5, 40, generator=gen) * 2, -1)
    logq = torch.log_softmax(torch.randn(3, 5, 40, generator=gen) * 2, -1)
    full = (logp.exp() * (logp - logq)).sum(-1)
    vals, idx = logp.topk(40, -1)
    assert torch.allclose(_binned_kl(vals, logq.gather(-1, idx)), full, atol=1e-6)
    vals, idx = logp.topk(8, -1)
    binned = _binned_kl(vals, logq.gather(-1, idx))
    assert (binned <= full + 1e-6).all() and (binned > 0).all()


def test_paired_standard_errors_of_perplexity_agreement_and_kl():
    base = Metrics(top1=0.5, nll=1.0, tokens=200, correct=(50, 50), window_tokens=(100, 100),
                   window_nll=(100.0, 100.0))
    cand = Metrics(top1=0.5, nll=1.1, tokens=200, correct=(50, 50), window_tokens=(100, 100),
                   window_nll=(105.0, 115.0), window_agree=(90, 96), window_kl=(2.0, 4.0))
    assert math.isclose(cand.ratio(base, "ppl"), math.exp(0.1))
    d = 0.1  # (5 + 15) / 200
    want = math.exp(0.1) * math.sqrt(2 * ((5 - d * 100) ** 2 + (15 - d * 100) ** 2)) / 200
    assert math.isclose(cand.ppl_ratio_se(base), want)
    assert cand.agreement == 0.93 and math.isclose(cand.kl, 0.03)
    assert math.isclose(cand.agreement_se(), math.sqrt(2 * (3.0 ** 2 + 3.0 ** 2)) / 200)
    assert math.isclose(cand.kl_se(), math.sqrt(2 * (1.0 ** 2 + 1.0 ** 2)) / 200)


def test_replaying_the_untouched_first_layers_scores_exactly_as_running_them():
    """The sensitivity probes compress one layer: with replay=True the layers before it return the original's
    recorded outputs instead of running, and every figure is the same to the last bit."""
    arch = "LlamaForCausalLM"
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    stats = tiny_stats(model, arch)
    d, g = layout.head_dim, layout.num_kv_heads
    bases = [get_method("aware").basis(stats, i, o_proj_heads(model, adapter, i)) for i in range(layout.num_layers)]
    windows = random_sequences(VOCAB, 256, 64, seed=4)
    plain = Evaluator(model, adapter, windows, batch=2, compare=False)
    replay = Evaluator(model, adapter, windows, batch=2, replay=True, compare=False)
    assert repr(replay.baseline) == repr(plain.baseline)  # repr: exact floats, and NaN (no KL here) == NaN
    last = layout.num_layers - 1
    probe = [b.truncate([d] * g, [d] * g) for b in bases[:last]] + [bases[last].truncate([4] * g, [d] * g)]
    calls = []
    first = adapter.decoder_layers(model)[0]
    hook = adapter.attention_modules(model)[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got = replay.score(probe, compare=False)
        assert calls == []  # layer 0 was replayed, not run
        want = plain.score(probe, compare=False)
        assert len(calls) == 2  # run once per batch
    finally:
        hook.remove()
    assert repr(got) == repr(want) and got.nll > replay.baseline.nll
    assert "forward" not in vars(first)  # the replay is undone
    with pytest.raises(ValueError, match="compare=False"):
        replay.score(probe)


def test_scores_are_summed_per_block_of_each_windows_scored_positions():
    """block=: each window's scored positions are cut into near-equal runs of at most `block` tokens, and the sums
    behind the standard errors are kept per run, in order; the totals are the per-window totals."""
    model = build_tiny("LlamaForCausalLM")
    windows = random_sequences(VOCAB, 256, 64, seed=3)  # 4 windows of 64 tokens: 54 scored from 10
    ref = Reference([], [])
    whole = score_model(model, windows, batch=2, keep=ref, start=10, block=64)
    blocks = score_model(model, windows, batch=2, keep=Reference([], []), start=10, block=20)
    assert whole.window_tokens == (54,) * 4 and blocks.window_tokens == (18, 18, 18) * 4
    assert sum(blocks.correct) == sum(whole.correct) and math.isclose(blocks.nll, whole.nll, rel_tol=1e-12)
    assert [sum(blocks.window_nll[3 * w:3 * w + 3]) for w in range(4)] == pytest.approx(list(whole.window_nll))
    again = score_model(model, windows, batch=2, against=ref, start=10, block=20)
    assert len(again.window_kl) == len(again.window_agree) == 12 and again.ppl_ratio_se(blocks) == 0.0
    mixed = Sequences(windows.ids, windows.groups, parts=[0, 1, 0, 1])  # a mixture's text per window
    parts = score_model(model, mixed, batch=2, start=10, block=20)
    assert parts.window_part == (0, 0, 0, 1, 1, 1) * 2 and parts.part(1).window_tokens == (18,) * 6
