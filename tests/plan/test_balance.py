"""Balancing per-head widths over tensor-parallel ranks (plan/ranks.balance): every rank ends with the widest
rank's sum, by adding the dims that carry the most of their head's spectrum, never removing one."""

import torch

from kvfold.plan.ranks import balance


def _spectra(*heads):
    return torch.tensor(heads, dtype=torch.float64)


def test_lighter_ranks_rise_to_the_widest_never_fall():
    # 4 KV heads of 8 dims, TP 2: ranks {0, 1} hold 6 + 4 = 10, {2, 3} hold 2 + 2 = 4
    flat = [1.0] * 8
    steep = [8.0, 4.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.0625]
    spectra = _spectra(flat, flat, flat, steep)
    out = balance([6, 4, 2, 2], spectra, tp=2, multiple=1)
    assert out[:2] == [6, 4] and sum(out[2:]) == 10
    # head 2 (flat) gives 1/8 of its spectrum per dim, head 3's next dims at most 1/14: head 2 gets the dims
    assert out[2:] == [8, 2]


def test_multiple_steps_and_the_head_width_cap():
    spectra = _spectra([1.0] * 8, [1.0] * 8, [1.0] * 8, [1.0] * 8)
    assert balance([8, 8, 0, 4], spectra, tp=2, multiple=4) in ([8, 8, 8, 8],)
    out = balance([8, 8, 8, 0], spectra, tp=4, multiple=4)  # every rank one head: all to the widest, 8
    assert out == [8, 8, 8, 8]


def test_balanced_and_single_rank_widths_are_unchanged():
    spectra = _spectra([1.0] * 8, [1.0] * 8, [1.0] * 8, [1.0] * 8)
    assert balance([8, 0, 4, 4], spectra, tp=2, multiple=1) == [8, 0, 4, 4]
    assert balance([8, 0, 4, 4], spectra, tp=1, multiple=1) == [8, 0, 4, 4]
