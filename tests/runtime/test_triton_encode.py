"""The GPU's band-code writer (kernels/triton_encode.py, one launch for a side's rows) gives exactly
bands.encode_heads' bytes: every width, dims no band holds, 16-bit bands, rows of zeros, values across the whole
log8 range, bfloat16 input, leading dims; and on CUDA every writer (torch_bits.encode_rows: vLLM's and transformers'
paths) takes it. On CUDA when there is one,
else in Triton's interpreter."""

import os

import pytest
import torch

from kvfold_runtime.bands import bands_from_bits, encode_heads
from tests.conftest import rerun_in_triton_interpreter
from tests.runtime.test_torch_bits import _random_heads, _rows_to_encode
from tests.runtime.test_triton_bits import LAYERS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter and not test_the_cuda_path")


@kernels
def test_the_triton_writer_writes_encode_heads_bytes():
    from kvfold_runtime.kernels.triton_encode import encode_rows_triton

    g = torch.Generator().manual_seed(5)
    cases = [(d.d_k, d.k_bands) for d in LAYERS.values()] + [(d.d_v, d.v_bands) for d in LAYERS.values()]
    cases += [((13, 64, 7), _random_heads((13, 64, 7), g)) for _ in range(4)]
    cases += [((64,), (bands_from_bits([16] * 64),))]  # no band quantized: float16 bits only
    for widths, bands in cases:
        x = _rows_to_encode(sum(widths), g)[::3]  # 14 rows: the zeros, the huge and the tiny one among them
        for rows in (x, x * 3e-5, x.bfloat16()):
            want = encode_heads(rows, widths, bands)
            assert torch.equal(encode_rows_triton(rows.to(DEVICE), widths, bands).cpu(), want), (widths, bands)
        lead = encode_rows_triton(x[:6].view(2, 3, -1).to(DEVICE), widths, bands).cpu()
        assert torch.equal(lead, encode_heads(x[:6], widths, bands).view(2, 3, -1))


@kernels
@pytest.mark.skipif(DEVICE != "cuda", reason="the CPU path's encoder is C or torch (test_torch_bits)")
def test_the_cuda_path_writes_with_it(monkeypatch):
    from kvfold_runtime.kernels import paged, triton_encode

    calls = []
    real = triton_encode.encode_rows_triton
    monkeypatch.setattr(triton_encode, "encode_rows_triton", lambda *a: calls.append(a[1]) or real(*a))
    dims = LAYERS["uneven"]
    k, v = torch.randn(5, sum(dims.d_k), device=DEVICE), torch.randn(5, sum(dims.d_v), device=DEVICE)
    rows = paged.BandRows(dims).encode(k, v, torch.uint8)
    assert calls == [dims.d_k, dims.d_v]
    assert torch.equal(rows.cpu(), torch.cat([encode_heads(k.cpu(), dims.d_k, dims.k_bands),
                                              encode_heads(v.cpu(), dims.d_v, dims.v_bands)], -1))
