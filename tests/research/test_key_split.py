"""research/key_split.py: kvfold-bits-k2 with other K/V splits, registered into the bench's frontier."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfold.plan.bits import V_SCALE, BitRule, plan_bits, theta_for_mean_bits
from kvfold.plan.formats.bits import band_align_for
from kvfold_bench.frontier.methods import DEFAULT, METHODS
from research.key_split import FACTORS, register_variants
from tests.bench.conftest import setup as setup  # the tiny frontier, a module fixture


def test_the_split_variants_move_bytes_between_keys_and_values(setup):
    """kvfold-bits-k2-vF: θ_v/θ_k = F·V_SCALE, keys down to 2 bits; named only; at equal mean bits a larger F puts
    more of the bits on keys."""
    register_variants()
    register_variants()  # again: nothing changes
    names = [f"kvfold-bits-k2-v{f:g}" for f in FACTORS]
    assert all(METHODS[n].v_scale == pytest.approx(f * V_SCALE) and METHODS[n].key_min == 2
               for n, f in zip(names, FACTORS, strict=True))
    assert not set(names) & set(DEFAULT)
    bases = setup.bases("aware", "text")
    align = band_align_for(setup.model.config.head_dim)

    def key_bits(method):
        m = replace(method, grid=(3.0,))
        theta = theta_for_mean_bits(bases, 3.0, BitRule(1, 1).widths, m.v_scale, align=align, key_min=2)
        plan = plan_bits(bases, BitRule(theta, m.v_scale * theta, align=align, key_min=2))
        return sum(b for layer in plan.k_bits for head in layer for b in head)

    assert key_bits(METHODS[names[0]]) < key_bits(METHODS[names[-1]])
