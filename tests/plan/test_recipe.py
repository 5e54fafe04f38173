from pathlib import Path

import pytest
import yaml

from kvfold.errors import KVFoldError
from kvfold.plan.recipe import Recipe, RecipeOverrides, load_recipe

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_recipes_are_shipped():
    assert len(RECIPES) >= 4


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate_and_round_trip(path):
    recipe = Recipe.model_validate(yaml.safe_load(path.read_text()))
    assert Recipe.model_validate(recipe.model_dump()) == recipe


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("accuracy: 0.99\nmultiple: 16\n")
    r = load_recipe(f, RecipeOverrides(multiple=8, ratio=None, method=None))
    assert (r.accuracy, r.multiple) == (0.99, 8)
    r = load_recipe(f, RecipeOverrides(ratio=0.2))  # a target flag replaces the file's target
    assert (r.accuracy, r.ratio) == (None, 0.2)


def test_unknown_keys_and_bad_yaml_are_one_line_errors(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("accuracy: 0.99\naccuracyy: 0.5\n")
    with pytest.raises(KVFoldError, match=r"--accuracyy: Extra inputs are not permitted"):
        load_recipe(f)
    f.write_text("accuracy: [0.99\n")
    with pytest.raises(KVFoldError, match="not valid YAML"):
        load_recipe(f)


def test_the_default_target_is_joint_and_max_kl_chooses_the_kl_metric():
    r = Recipe(accuracy=0.99)
    assert (r.metric, r.margin) == ("joint", 1.0) and r.target().describe().startswith("top-1 ratio ≥ 0.99 and")
    r = load_recipe(None, RecipeOverrides(max_kl=0.01))
    assert r.metric == "kl" and r.target().level == 0.01 and r.target().describe() == "mean KL ≤ 0.01 (1 se)"
    assert Recipe(ratio=0.1).target() is None
    with pytest.raises(KVFoldError, match="the kl metric takes --max-kl"):
        load_recipe(None, RecipeOverrides(accuracy=0.99, metric="kl"))
    with pytest.raises(KVFoldError, match="exactly one of accuracy, ratio or max_kl"):
        load_recipe(None, RecipeOverrides(accuracy=0.99, max_kl=0.01))


def test_the_allocation_defaults_by_format_and_a_given_one_is_kept():
    rank, bits = Recipe(accuracy=0.99), Recipe(accuracy=0.99, format="bits")
    assert (rank.allocation, rank.sensitivity_tokens, rank.v_scale) == ("eq6", 4096, 1.0)
    assert (bits.allocation, bits.sensitivity_tokens, bits.v_scale) == ("eq6", 2048, 32.0)
    given = Recipe(accuracy=0.99, format="bits", allocation="sensitivity", sensitivity_tokens=512)
    assert (given.allocation, given.sensitivity_tokens) == ("sensitivity", 512)


def test_band_align_is_the_bits_formats_own_and_recorded_as_its_rank_rounding():
    """Bits: bands on chunks of 8 dims at head_dim ≤ 64 and 16 above unless given (1: anywhere, the older
    allocation), filled in once the model is known (CacheFormat.resolve); the ranks follow from the bits, so they
    are multiples of it (Recipe.rounding: the manifest's rounding_multiple). The rank format has no bands and
    refuses the option, naming its own."""
    from kvfold.plan.formats import get_format

    bits = Recipe(accuracy=0.99, format="bits")
    assert bits.band_align is None
    fmt = get_format("bits")
    assert [(r.band_align, r.rounding) for r in (fmt.resolve(bits, 64, 2048), fmt.resolve(bits, 128, 2048))] == [
        (8, (8, 0)), (16, (16, 0))]
    assert fmt.resolve(bits.model_copy(update={"band_align": 32}), 64, 2048).band_align == 32
    bits = fmt.resolve(bits, 128, 2048)
    assert load_recipe(None, {"accuracy": 0.99, "format": "bits", "band_align": 1}).rounding == (1, 0)
    assert Recipe(accuracy=0.99).band_align is None
    assert Recipe.model_validate(bits.model_dump()) == bits
    with pytest.raises(KVFoldError, match="--band-align places the bits format's bands; the rank format rounds its "
                                          "ranks with --multiple"):
        load_recipe(None, {"accuracy": 0.99, "band_align": 16})
    with pytest.raises(KVFoldError, match="--band-align: Input should be greater than or equal to 1"):
        load_recipe(None, {"accuracy": 0.99, "format": "bits", "band_align": 0})


def test_a_long_context_model_gets_the_windowed_bits_format_judged_at_long_context():
    """Bits: a model whose positions reach 4,096 keeps 16 sink and 64 recent tokens whole by default, and a windowed
    recipe is searched in 4,096-token windows from position 1,024 (or the model's positions, scored from a quarter
    in); a shorter model, the rank format, and `--window 0 --sinks 0` keep the plain cache judged in 512-token
    windows. Given values stay; a --score-from past the windows is an error naming the flag."""
    from kvfold.plan.formats import get_format

    bits, rank = get_format("bits"), get_format("rank")
    got = bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 8192)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (16, 64, 4096, 1024)
    got = bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 2048)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (0, 0, 512, 1)
    got = bits.resolve(Recipe(accuracy=0.99, format="bits", sinks=0, window=0), 64, 8192)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (0, 0, 512, 1)
    got = bits.resolve(Recipe(accuracy=0.99, format="bits", sinks=4, window=32), 64, 2048)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (4, 32, 2048, 512)
    got = bits.resolve(Recipe(accuracy=0.99, format="bits", window=8, search_context=256), 64, 8192)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (0, 8, 256, 64)
    got = rank.resolve(Recipe(accuracy=0.99), 64, 8192)
    assert (got.sinks, got.window, got.search_context, got.score_from) == (0, 0, 512, 1)
    with pytest.raises(ValueError, match="--score-from must be less than --search-context"):
        bits.resolve(Recipe(accuracy=0.99, format="bits", score_from=4096), 64, 8192)


def test_keys_take_four_bits_or_more_unless_told():
    """--key-bits: the narrowest key band is 4 bits by default in the plain bits cache, and left to the search
    (None) in the windowed one (plan/formats/bits.KEY_FLOORS); a given value stays and reaches the search's rule; the
    rank format refuses it."""
    from kvfold.plan.formats import get_format

    bits = get_format("bits")
    assert bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 8192).key_bits is None  # windowed by default
    assert bits.resolve(Recipe(accuracy=0.99, format="bits", sinks=0, window=0), 64, 8192).key_bits == 4
    assert bits.resolve(Recipe(accuracy=0.99, format="bits"), 64, 2048).key_bits == 4
    given = bits.resolve(Recipe(accuracy=0.99, format="bits", key_bits=3), 64, 8192)
    assert given.key_bits == 3 and bits.rule(given, 1e-3, 1e-2, {}).key_min == 3
    with pytest.raises(ValueError, match="--key-bits sets the bits format"):
        Recipe(accuracy=0.99, key_bits=2)


def test_overrides_are_the_recipes_fields_and_errors_name_the_flag():
    """The command line's overrides are every Recipe field, declared once (in Recipe); Recipe checks them, so
    a bad choice names its flag. Python callers may pass a mapping of the same fields."""
    assert set(RecipeOverrides.model_fields) == set(Recipe.model_fields)
    assert RecipeOverrides().model_dump(exclude_none=True) == {}
    with pytest.raises(KVFoldError, match="--method: Input should be 'aware' or 'zack'"):
        load_recipe(None, RecipeOverrides(accuracy=0.9, method="magic"))
    with pytest.raises(KVFoldError, match="--eval-tokens: Input should be a valid integer"):
        load_recipe(None, {"accuracy": 0.9, "eval_tokens": "many"})
    assert load_recipe(None, {"accuracy": 0.9, "eval_tokens": 512}) == Recipe(accuracy=0.9, eval_tokens=512)
    assert Recipe(accuracy=0.9).rounding == (8, 8)
    assert Recipe(accuracy=0.9, format="bits", band_align=16).rounding == (16, 0)
