"""The bit-band cache format (kvfold_runtime.bands): layout, bytes and each width's error bound."""

import pytest
import torch

from kvfold_runtime.bands import (
    FIT_STEPS,
    SCALES,
    Band,
    bands_from_bits,
    dequantize,
    log8_scales,
    quantize,
    roundtrip,
    row_bytes,
)

BITS = [16] * 2 + [8] * 5 + [6] * 3 + [5] * 4 + [4] * 10 + [3] * 9 + [2] * 21 + [0] * 10


def test_equal_widths_form_contiguous_bands_and_zero_bits_are_not_stored():
    bands = bands_from_bits(BITS)
    assert [(b.start, b.size, b.bits) for b in bands] == [
        (0, 2, 16), (2, 5, 8), (7, 3, 6), (10, 4, 5), (14, 10, 4), (24, 9, 3), (33, 21, 2)]
    # codes byte-aligned per band, one scale per band below 16 bits: one byte (log8, the default) or two
    assert row_bytes(bands) == 4 + 5 + 3 + 3 + 5 + 4 + 6 + 6 * 1
    assert row_bytes(bands_from_bits(BITS, "float16")) == 4 + 5 + 3 + 3 + 5 + 4 + 6 + 6 * 2
    with pytest.raises(ValueError, match="must not increase"):
        bands_from_bits([4, 8])
    with pytest.raises(ValueError, match="among"):
        bands_from_bits([7])
    with pytest.raises(ValueError, match="scale format"):
        bands_from_bits([4], "float8")


@pytest.mark.parametrize(("scale", "coarsest"), [("log8", 2 ** (1 / 8)), ("float16", 1 + 2**-10)])
def test_each_band_round_trips_at_its_fitted_step_and_16_bits_is_float16(scale, coarsest):
    torch.manual_seed(0)
    # [B, T, d]: magnitudes fall along the dims, and vary by token over 2^±6 (every log8 step is hit)
    x = torch.randn(3, 7, 64) * torch.logspace(1, -2, 64) * torch.exp2(torch.linspace(-6, 6, 7))[:, None]
    bands = bands_from_bits(BITS, scale)
    codes, scales = quantize(x, bands)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 7, sum(b.code_bytes for b in bands))
    assert scales.dtype == torch.uint8 and scales.shape == (3, 7, 6 * SCALES[scale])
    y = dequantize(codes, scales, bands, 64)
    fitted_below = scale == "float16"
    for k, band in enumerate(bands[1:]):
        part = slice(band.start, band.start + band.size)
        raw = scales[..., k * SCALES[scale] : (k + 1) * SCALES[scale]]
        step = (raw.contiguous().view(torch.float16).float() if scale == "float16"
                else torch.exp2((raw.float() - 128) / 8))
        # the covering step: the band's absmax over its outermost level, rounded up to the scale format's next value
        ideal = x[..., part].abs().amax(-1, keepdim=True) / (2 ** (band.bits - 1) - 0.5)
        if scale == "float16":  # legacy exports keep the covering step: no value clipped
            assert torch.all(step >= ideal) and torch.all(step <= ideal * coarsest * (1 + 1e-6))
            assert torch.all((x[..., part] - y[..., part]).abs() <= step / 2 * (1 + 1e-6))
            continue
        # log8: the covering step or one of the FIT_STEPS below it, whichever rounds the band best
        table = log8_scales()  # the 256 scales a log8 byte stands for
        steps_up = raw.long() - 128
        cover = torch.bucketize(ideal, table) - 128
        assert torch.all(steps_up <= cover) and torch.all(steps_up >= cover - FIT_STEPS)
        fitted_below = fitted_below or bool((steps_up < cover).any())
        err = (x[..., part] - y[..., part]).square().sum(-1)
        for k in range(FIT_STEPS + 1):
            s_k = table[(cover + 128 - k).clamp(min=0)]
            level = torch.floor(x[..., part] / s_k + 2 ** (band.bits - 1)).clamp(0, 2**band.bits - 1)
            other = ((level + 0.5 - 2 ** (band.bits - 1)) * s_k - x[..., part]).square().sum(-1)
            assert torch.all(err <= other)
        unclipped = x[..., part].abs() <= (2 ** (band.bits - 1)) * step  # inside the outermost level's cell
        assert torch.all(((x[..., part] - y[..., part]).abs() <= step / 2 * (1 + 1e-6))[unclipped])
    assert fitted_below, "no band's fitted step fell below its covering one"
    assert torch.equal(y[..., :2], x[..., :2].half().float())
    assert torch.equal(y[..., 54:], torch.zeros(3, 7, 10))
    assert torch.equal(roundtrip(x, bands), y)


def test_every_code_of_a_width_is_reachable_and_packing_is_exact():
    for bits in (2, 3, 4, 5, 6, 8):
        levels = 2**bits
        # values at every level centre of a band whose absmax is the outermost level
        x = (torch.arange(levels, dtype=torch.float32) + 0.5 - levels / 2)[None, :]
        band = (Band(0, levels, bits),)
        codes, scales = quantize(x, band)
        assert codes.shape[-1] == -(-levels * bits // 8) and int(scales) == 128  # log8's byte of 1.0
        assert torch.equal(dequantize(codes, scales, band, levels), x)


def test_odd_width_rows_and_heads_without_scales_decode():
    """A head whose kept dims are all at 16 bits has no scales (it crashed a bits-format export's verify:
    torch cannot view an empty byte tensor as float16), and a decode step reads one token of rows that may
    be an odd number of bytes (float16 scales: older exports)."""
    from kvfold_runtime.bands import decode_heads, encode_heads

    heads = tuple(bands_from_bits(b, "float16") for b in ([16, 8], [16, 16], [8, 8]))  # 2+1+2, 4, 2+2 bytes
    widths = (2, 2, 2)
    x = torch.randn(2, 5, sum(widths), generator=torch.Generator().manual_seed(0))
    rows = encode_heads(x, widths, heads)
    assert rows.shape[-1] % 2 == 1
    wide = torch.cat([rows, rows], -1)  # a cache row of two layers' bytes: every slice has odd strides
    for t in range(x.shape[1]):
        one = decode_heads(wide[:, t : t + 1, : rows.shape[-1]], widths, heads, torch.float32)
        assert torch.equal(one, decode_heads(rows[:, t : t + 1].clone(), widths, heads, torch.float32))
