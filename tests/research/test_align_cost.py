"""research/align_cost.py: the modelled price of 16-dim-aligned bands at equal bits."""

from __future__ import annotations

from research.align_cost import cost_db, log_linear


def test_aligning_to_one_dim_costs_nothing_and_to_16_a_finite_amount():
    heads = log_linear(32, 6)
    assert cost_db(heads, 4.0, align=1) == {"keys": 0.0, "values": 0.0, "both": 0.0}
    db = cost_db(heads, 4.0, align=16, with_scales=True)
    assert -1.0 < db["both"] < 20.0 and set(db) == {"keys", "values", "both"}
