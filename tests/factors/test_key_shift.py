"""The keys' shift (kvfold_runtime.format.K_SHIFT): calibrated as the keys' mean, averaged over RoPE positions,
invisible to attention, and what keeps a shared key direction out of the stored codes."""

import math

import torch

from kvfold.calib.artifact import CalibStats
from kvfold.calib.sinks import GramSink
from kvfold.factors import LayerFactors
from kvfold.factors.positions import position_average_mean
from kvfold.measure.stored import banded, compressed
from kvfold_runtime import bands_from_bits
from tests.test_cli import run


def test_the_gram_sink_records_the_keys_mean_and_only_theirs():
    sink, gen = GramSink(), torch.Generator().manual_seed(0)
    parts = [torch.randn(2, n, 8, generator=gen) + 3.0 for n in (5, 11)]
    for x in parts:
        sink.add("layers.0.k", x)
        sink.add("layers.0.q", x)
    out = sink.result()
    assert set(out) == {"layers.0.k", "layers.0.q", "layers.0.k_mean"}
    torch.testing.assert_close(out["layers.0.k_mean"], torch.cat(parts, 1).double().mean(1))


def test_the_position_averaged_mean_is_the_mean_over_every_shift():
    """RoPE (rotate_half pairing) turns plane a = dims (a, a + d/2) by ω_a·s; averaging the rotated mean over
    s ∈ [0, C) by brute force gives the closed form."""
    d, context, gen = 8, 300, torch.Generator().manual_seed(1)
    inv_freq = torch.tensor([1.0, 0.1, 0.01, 1e-4], dtype=torch.float64)
    mean = torch.randn(3, d, generator=gen, dtype=torch.float64)
    s = torch.arange(context, dtype=torch.float64)[:, None] * inv_freq  # [C, d/2]
    cos, sin = s.cos(), s.sin()
    x1, x2 = mean[:, None, : d // 2], mean[:, None, d // 2 :]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # [3, C, d]
    torch.testing.assert_close(position_average_mean(mean, inv_freq, context), rotated.mean(1))


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


def test_the_shift_leaves_attention_unchanged_and_shrinks_the_stored_keys_error():
    """Keys sharing a large direction (as a K bias gives): subtracting it changes no attention weight, and a 4-bit
    band whose scale that direction no longer sets stores the spread far more finely."""
    d, gen = 16, torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 64, d, generator=gen)
    offset = torch.zeros(d)
    offset[0] = 40.0
    k = torch.randn(1, 1, 64, d, generator=gen) + offset
    v = torch.randn(1, 1, 64, d, generator=gen)
    eye = torch.eye(d)
    plain = LayerFactors(qk_a=[eye, eye], qk_b=[eye], v_a=[eye], o_b=[eye, eye], group=2)
    shifted = LayerFactors(qk_a=[eye, eye], qk_b=[eye], v_a=[eye], o_b=[eye, eye], group=2,
                           k_mean=offset[None].double())
    exact = _attention(q, k.expand(1, 2, 64, d), v.expand(1, 2, 64, d))
    # unquantized: the same attention to round-off
    qs, ks, vs = compressed(shifted, torch.float32).before(q, k, v)
    torch.testing.assert_close(_attention(qs, ks.expand(1, 2, 64, d), vs.expand(1, 2, 64, d)), exact)
    four_bits = banded([bands_from_bits([4] * d)])
    errors = []
    for factors in (plain, shifted):
        qs, ks, vs = compressed(factors, torch.float32, four_bits, lambda x: x).before(q, k, v)
        errors.append(float((_attention(qs, ks.expand(1, 2, 64, d), vs.expand(1, 2, 64, d)) - exact).norm()))
    assert errors[1] < 0.2 * errors[0], errors


def test_a_calibration_without_means_still_exports_without_a_shift(tiny_dirs, tmp_path):
    """Calibrations written before schema 1.1 have no key means: the export has no shift, and says so in
    config.json (no key_shift)."""
    import json

    model = tiny_dirs["LlamaForCausalLM"]
    calib, out, text = tmp_path / "c", tmp_path / "o", tmp_path / "t.txt"
    text.write_text("\n\n".join(f"line {i} of some text" for i in range(50)))
    assert run("calibrate", model, "-o", calib, "--tokens", 256, "--seq-len", 64).exit_code == 0
    stats = CalibStats.load(calib)
    old = {n: g for n, g in stats.grams.items() if not n.endswith("k_mean")}
    CalibStats(header=stats.header.model_copy(update={"schema_version": "1.0"}), grams=old).save(calib)
    result = run("export", model, "--calib", calib, "--eval-text", text, "--eval-tokens", 128, "--ratio", 0.25,
                 "-o", out)
    assert result.exit_code == 0, result.output
    block = json.loads((out / "config.json").read_text())["kvfold"]
    assert "key_shift" not in block and block["post_rope_projections"]
