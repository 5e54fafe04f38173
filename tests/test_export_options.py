"""kvfold export's allocation options on a tiny model: sensitivity scales kept through a reused curve, the bits
format's band alignment (--band-align), tensor-parallel balancing (--tp), and their bad inputs."""

import pytest

from kvfold.checkpoint.manifest import Manifest
from tests.test_cli import assert_user_error
from tests.test_export import _export, export_setup


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    return export_setup(tiny_dirs, tmp_path_factory)


def test_reuse_keeps_the_recorded_layer_scales(setup, tmp_path, monkeypatch):
    """A sensitivity export records its per-layer scales (plan/sensitivity.LayerScales, Manifest.layer_scales);
    a reused curve plans with those very scales, measuring nothing, and records them again."""
    first, second = tmp_path / "a", tmp_path / "b"
    assert _export(setup, first, "--accuracy", 0.5, "--allocation", "sensitivity").exit_code == 0
    prev = Manifest.load(first)
    weights = prev.layer_scales()
    assert weights is not None and len(weights.k) == len(weights.cost_v) == 2 and list(weights.k) == prev.layer_scale_k
    monkeypatch.setattr("kvfold.plan.planner.Evaluator", lambda *a, **k: pytest.fail("--reuse-curve must not evaluate"))
    result = _export(setup, second, "--accuracy", 0.5, "--allocation", "sensitivity", "--reuse-curve", first)
    assert result.exit_code == 0, result.output
    m = Manifest.load(second)
    assert m.layer_scales() == weights and (m.chosen, m.d_k, m.d_v) == (prev.chosen, prev.d_k, prev.d_v)


def test_a_bits_sensitivity_export_records_per_head_rounding_scales_and_reuse_keeps_them(setup, tmp_path, monkeypatch):
    """The bits format's sensitivity allocation is per KV head (plan/rounding.HeadScales): recorded in the
    manifest, and a reused curve plans with those very scales, measuring nothing."""
    first, second = tmp_path / "a", tmp_path / "b"
    bits = ("--accuracy", 0.5, "--format", "bits", "--passkey", 0, "--allocation", "sensitivity")
    result = _export(setup, first, *bits)
    assert result.exit_code == 0, result.output
    prev = Manifest.load(first)
    scales = prev.layer_scales()
    assert prev.allocation == "sensitivity" and prev.layer_scale_k == []
    assert [len(layer) for layer in scales.k + scales.cost_v] == [prev.num_kv_heads] * 4
    assert list(map(list, scales.k)) == prev.head_scale_k
    monkeypatch.setattr("kvfold.plan.planner.Evaluator", lambda *a, **k: pytest.fail("--reuse-curve must not evaluate"))
    result = _export(setup, second, *bits, "--reuse-curve", first)
    assert result.exit_code == 0, result.output
    m = Manifest.load(second)
    assert m.layer_scales() == scales and (m.chosen, m.k_bits, m.v_bits) == (prev.chosen, prev.k_bits, prev.v_bits)


def test_a_bits_export_aligns_its_bands_and_band_align_1_is_the_older_allocation(setup, tmp_path):
    """Every band of a bits export starts and ends on a multiple of 8 dims at the tiny model's head_dim 16 (head_dim
    ≤ 64: formats/bits.band_align_for) or of --band-align's (16: one width per head), recorded as its rank rounding;
    --band-align 1 plans bands anywhere, and neither reuses the other's curve."""
    bits = ("--accuracy", 0.5, "--format", "bits", "--passkey", 0)
    for name, extra, align in (("aligned", (), 8), ("sixteen", ("--band-align", 16), 16),
                               ("loose", ("--band-align", 1), 1)):
        result = _export(setup, tmp_path / name, *bits, *extra)
        assert result.exit_code == 0, result.output
        m = Manifest.load(tmp_path / name)
        assert m.rounding_multiple == align and m.min_rank == 0
        for head in (h for side in (m.k_bits, m.v_bits) for layer in side for h in layer):  # kept dims' widths
            chunks = [head[c : c + align] for c in range(0, len(head), align)]
            assert len(head) % align == 0 and all(len(set(chunk)) == 1 for chunk in chunks)
    assert_user_error(_export(setup, tmp_path / "x", *bits, "--reuse-curve", tmp_path / "loose"),
                      "was searched with a different rank rounding", tmp_path / "x")


@pytest.mark.parametrize(("flags", "message"), [
    (["--format", "bits", "--band-align", 32],
     "head_dim 16 is not a multiple of the bits format's band alignment 32: export with --band-align 1"),
    (["--band-align", 16], "--band-align places the bits format's bands; the rank format rounds its ranks with"),
])
def test_band_align_bad_input(setup, tmp_path, flags, message):
    assert_user_error(_export(setup, tmp_path / "x", "--accuracy", 0.9, *flags), message, tmp_path / "x")


def test_tp_balances_every_layer_over_the_ranks_and_is_recorded(setup, tmp_path):
    from kvfold_runtime import ConfigBlock
    from kvfold_runtime.sharding import check_tensor_parallel, padding_fraction

    out = tmp_path / "tp"
    result = _export(setup, out, "--ratio", 0.3, "--tp", 2, "--multiple", 1, "--min-rank", 1, "--passkey", 0)
    assert result.exit_code == 0, result.output
    m = Manifest.load(out)
    assert m.tensor_parallel == 2 and m.chosen.compression >= 0.3
    layers = ConfigBlock(m.d_k, m.d_v, True).layers(4, 2)
    assert padding_fraction(layers, 2) == 0  # the tiny model's 2 KV heads: one per rank, equal widths
    assert all(len(set(row)) == 1 for row in m.d_k + m.d_v)
    check_tensor_parallel(layers, 2)
    unbalanced = _export(setup, tmp_path / "one", "--ratio", 0.3, "--multiple", 1, "--min-rank", 1, "--passkey", 0)
    assert unbalanced.exit_code == 0 and Manifest.load(tmp_path / "one").tensor_parallel == 1


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", 3], "--tp 3: the model's 2 KV heads do not split over 3 tensor-parallel ranks"),
    (["--tp", 2, "--format", "bits"], "--tp balances the rank format's widths"),
])
def test_tp_bad_input(setup, tmp_path, flags, message):
    assert_user_error(_export(setup, tmp_path / "x", "--accuracy", 0.9, *flags), message, tmp_path / "x")


@pytest.mark.parametrize(("flags", "message"), [
    (["--search-context", 256, "--score-from", 256], "--score-from must be less than --search-context (256 tokens)"),
    (["--window", 8], "--sinks and --window keep tokens whole beside the bits format's codes"),
    (["--key-bits", 2], "--key-bits sets the bits format's narrowest key band"),
])
def test_long_context_search_bad_input(setup, tmp_path, flags, message):
    """The search's windows (--search-context, --score-from) and a windowed cache (--sinks, --window, bits only)."""
    assert_user_error(_export(setup, tmp_path / "x", "--accuracy", 0.9, *flags), message, tmp_path / "x")
