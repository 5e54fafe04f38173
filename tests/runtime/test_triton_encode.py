"""The GPU's band-code writer (kernels/triton_encode.py, one launch for a side's rows) gives exactly
bands.encode_heads' bytes: every width, dims no band holds, 16-bit bands, rows of zeros, values across the whole
log8 range, bfloat16 input, leading dims; its rows scattered into the GPU page layout by a kernel leave a cache
exactly as PageLayout.write leaves it; and on CUDA every writer takes them (torch_bits.encode_rows: vLLM's and
transformers' paths; write_paged into pages: write_pages). On CUDA when there is one, else in Triton's interpreter."""

import os

import pytest
import torch

from kvfold_runtime.bands import bands_from_bits, encode_heads
from tests.conftest import rerun_in_triton_interpreter
from tests.runtime.test_torch_bits import _random_heads, _rows_to_encode
from tests.runtime.test_triton_bits import LAYERS
from tests.runtime.test_triton_pages import LAYERS as LAYERS_PAGES
from tests.runtime.test_triton_pages import _kv, _rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter and not test_the_cuda_paths")


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
def test_the_cuda_paths_write_with_it(monkeypatch):
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
    # vLLM's write of a step into the GPU page layout: write_pages, not the layout's torch scatter
    pages = []
    real_pages = triton_encode.write_pages
    monkeypatch.setattr(triton_encode, "write_pages", lambda *a: pages.append(1) or real_pages(*a))
    dims = LAYERS_PAGES["mixed"]
    codec = paged.row_codec(dims, page=16)
    cache = torch.zeros(4, 1, 16, codec.layout.row_bytes, dtype=torch.uint8, device=DEVICE)
    k, v = _kv(dims, 5, torch.Generator().manual_seed(1))
    paged.write_paged(cache, torch.tensor([0, 9, -1, 33, 60], device=DEVICE), k.to(DEVICE), v.to(DEVICE), codec=codec)
    assert pages == [1] and cache.any()
    # a rank layer's numbers: copy_rows, no boolean mask
    copies = []
    real_copy = triton_encode.copy_rows
    monkeypatch.setattr(triton_encode, "copy_rows", lambda *a: copies.append(1) or real_copy(*a))
    numbers = torch.zeros(4, 1, 16, 24, dtype=torch.bfloat16, device=DEVICE)
    paged.write_paged(numbers, torch.tensor([5, -1], device=DEVICE), torch.ones(2, 12, device=DEVICE),
                      torch.ones(2, 12, device=DEVICE))
    assert copies == [1] and int((numbers != 0).sum()) == 24


@kernels
@pytest.mark.parametrize(("layer", "page"), [("mixed", 16), ("eighths", 32), ("one head", 16)])
def test_a_steps_rows_land_in_their_pages_as_the_layouts_write_puts_them(layer, page):
    """triton_encode.write_pages (encode, then scatter into the page layout in a kernel) leaves the cache exactly
    as PageLayout.write of encode_heads' rows does; a padding slot (−1) writes nothing, other tokens' bytes and the
    pages no slot names keep theirs."""
    from kvfold_runtime.kernels.triton_encode import write_pages
    from kvfold_runtime.pages import page_layout

    g = torch.Generator().manual_seed(page)
    dims = LAYERS_PAGES[layer]
    layout = page_layout(dims, page)
    cache = torch.randint(0, 256, (7, 1, page, layout.row_bytes), generator=g, dtype=torch.uint8)
    slots = torch.randperm(7 * page, generator=g)[:2 * page + 5]
    slots[[3, 17]] = -1  # padding, as vLLM's slot mapping marks it
    k, v = _kv(dims, slots.shape[0], g)
    want = cache.clone()
    keep = slots >= 0
    layout.write(want, slots[keep], _rows(dims, k[keep], v[keep]))
    got = cache.to(DEVICE)
    write_pages(got, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layout)
    assert torch.equal(got.cpu(), want)


@kernels
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("outer", [False, True], ids=["layer-compact", "block-outer"])
def test_a_steps_rows_land_in_their_slots_and_nowhere_else(dtype, outer):
    """triton_encode.copy_rows (a cache of rows: a rank layer's numbers, a windowed layer's codes): each kept token's
    row at its slot, in vLLM's layer-compact layout and in a block-outer one (each block a view into a larger one);
    a padding slot (−1) writes nothing, and no byte outside the slots' rows changes."""
    from kvfold_runtime.kernels.triton_encode import copy_rows

    g = torch.Generator().manual_seed(2)
    bs, c, blocks = 4, 24, 6

    def draw(*shape):
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=dtype)
        return torch.randn(*shape, generator=g).to(dtype)

    whole = draw(blocks, 3 if outer else 1, bs, c)
    slots = torch.randperm(blocks * bs, generator=g)[:9]
    slots[[2, 6]] = -1
    rows = draw(9, c)
    want = whole.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[slot // bs, 1 if outer else 0, slot % bs] = rows[i]
    got = whole.to(DEVICE)
    copy_rows(got[:, 1:2] if outer else got, slots.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), want)
