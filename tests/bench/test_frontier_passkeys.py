"""The frontier reads each method as export reads its own cache (bench/frontier/sweep.read_with_passkeys): the
smallest point at the joint target whose pass keys survive every rounding by export's margin rule, each rounding
drawn the same way for every method (patches.nudged)."""

import torch

from kvfold.hooks import patched
from kvfold.measure.passkey import passkey_answers
from kvfold.plan.longrange import judge
from kvfold_bench.frontier.methods.vllm_kv import ROUNDTRIPS
from kvfold_bench.frontier.patches import nudged, quantized_kv
from kvfold_bench.frontier.sweep import Point, read_with_passkeys
from tests.plan.test_longrange import _setup


def _through(patch, k):
    return patch.before(k, k, k)[1]  # the keys as the cache gives them back


def test_a_nudge_draws_another_rounding_of_a_per_token_scaled_cache():
    """vLLM's int4_per_token_head computes each token's float32 scale from the numbers themselves: scaling them
    all by one factor rounds every number as before, so a nudge flips signs per number instead. It moves the
    codes of a few tokens (a code flipped in the rotated basis moves the whole row) and leaves the rest within
    float round-off."""
    torch.manual_seed(0)
    k = torch.randn(1, 2, 8192, 64)
    patch = quantized_kv(ROUNDTRIPS["int4_per_token_head"])
    exact = _through(patch, k)

    def moved(out):  # tokens whose row moved by more than float round-off (a code flip: ~1/15 of the range)
        return int(((out - exact).abs().amax(-1) > 1e-3 * k.abs().amax(-1)).sum())

    assert moved(_through(patch, k * (1 + 1e-6)) / (1 + 1e-6)) == 0
    assert 0 < moved(_through(nudged({0: patch}, 1e-6)[0], k)) < 0.01 * 2 * 8192
    assert nudged({0: patch}, 0.0)[0] is patch


def test_the_reading_walks_up_to_the_first_point_that_keeps_the_keys():
    model, adapter, prompts, broken = _setup(4)
    original = passkey_answers(model, prompts)

    def point(kv, top1=1.0):
        return Point(knob=kv, kv_fraction=kv, top1_ratio=top1, top1_se=0.0, ppl_ratio=1.0)

    # by bytes: 0.2 misses the target, 0.25 loses the keys (values zeroed), 0.3 and 0.5 keep them exactly
    points = [point(0.5), point(0.3), point(0.25), point(0.2, top1=0.5)]
    patches = {0: {}, 1: {}, 2: broken, 3: {}}
    judged = []

    def check(i):
        judged.append(points[i].kv_fraction)
        with patched(model, adapter, patches[i]):
            return judge(original, [passkey_answers(model, prompts)])

    kept, checked = read_with_passkeys(points, 0.99, check)
    assert kept == 0.3 and judged == [0.25, 0.3]
    assert [c["kept"] for c in checked] == [False, True]
    assert checked[0]["retrieved"][0] < len(prompts) == checked[1]["retrieved"][0]
    assert checked[1]["spread"] == 0.0 and checked[1]["mean"] > 0  # one draw: the cache does not round
    # at most max_checks points are judged: none kept within them
    judged.clear()
    assert read_with_passkeys(points, 0.99, check, max_checks=1) == (None, checked[:1]) and judged == [0.25]
