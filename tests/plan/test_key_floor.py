"""A windowed bits export's key floor (plan/planner._search_floors): keys down to 2 bits where the point searched with
them keeps the pass keys as it is, else the search again with keys ≥ 4 bits and its own pass-key check. The searches
here are stand-ins that return chosen verdicts: what is tested is the choice between them, not a search (a real
export's choice: tests/test_verify.py's windowed export, and the SmolLM2 and Qwen exports in docs/)."""

import pytest

from kvfold.plan import planner
from kvfold.plan.export_plan import ExportInputs
from kvfold.plan.journal import Journal
from kvfold.plan.point import Point
from kvfold.plan.recipe import Recipe


def _point(p: float) -> Point:
    return Point(0, 0, p, top1_ratio=1.0, ppl_ratio=1.0, top1_se=0.0, ppl_se=0.0)


@pytest.mark.parametrize("lose", [False, True])
def test_keys_go_to_two_bits_only_where_that_point_keeps_the_pass_keys(monkeypatch, lose):
    searched = []
    rejected = {"compression": 0.8, "retrieved": 8, "mean": -0.82, "spread": 0.1}

    def search(inputs, fmt, net, bases, scoring, target, rule, log, journal, first_only=False):
        floor = inputs.recipe.key_bits
        searched.append((floor, first_only, rule(1e-3).key_min))
        point = _point(0.8 if floor == 2 else 0.7)
        if floor == 2 and lose:
            return planner._Found(point, (point,), None, {"rejected": [rejected]}, net, rule, lost=True)
        return planner._Found(point, (point,), None, {"retrieved": 10, "rejected": []}, net, rule)

    monkeypatch.setattr(planner, "_search", search)
    monkeypatch.setattr(planner._Scoring, "of", classmethod(lambda cls, *args: None))
    recipe = Recipe(accuracy=0.99, format="bits", sinks=16, window=64, band_align=8)
    inputs = ExportInputs(ref=None, stats=None, recipe=recipe, weights_sha256="", previous=None, docs=None)
    found = planner._search_floors(inputs, planner.get_format("bits"), None, [], None, None, None, print,
                                   Journal(None))
    if lose:  # the 2-bit point lost a key: the search again with keys ≥ 4 bits, its own check in full
        assert searched == [(2, True, 2), (4, False, 4)]
        assert found.best.compression == 0.7 and found.rule(1e-3).key_min == 4
        assert found.passkey["lower_key_bits"] == [{"key_bits": 2, **rejected}]
    else:
        assert searched == [(2, True, 2)]
        assert found.best.compression == 0.8 and found.rule(1e-3).key_min == 2 and not found.lost
        assert "lower_key_bits" not in found.passkey


def test_only_a_windowed_bits_export_without_key_bits_searches_two_floors():
    from kvfold.plan.formats import get_format

    bits, rank = get_format("bits"), get_format("rank")
    windowed = bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 8192)
    assert bits.key_floors(windowed) == (2, 4)
    assert bits.key_floors(bits.resolve(Recipe(accuracy=0.99, format="bits", key_bits=3), 64, 8192)) == (3,)
    assert bits.key_floors(bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 2048)) == (4,)  # plain: 4
    assert rank.key_floors(Recipe(accuracy=0.99)) == (None,)  # the rank format has no key floor: one search
