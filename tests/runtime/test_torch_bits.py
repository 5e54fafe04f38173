"""The CPU path's table-driven band decoder and encoder (kernels/torch_bits.py) give exactly decode_heads' values
— on rows encode_heads wrote and on arbitrary bytes (a freed block's), for every band width and both scale
formats — and encode_heads' bytes (every width, dims no band holds, rows of zeros, scales at both ends of the
log8 range, compiled and eager); the paged torch path's per-step plan is made once per step and reused by the
step's other layers."""

import dataclasses
import gc
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvfold_runtime import BandRows, write_paged
from kvfold_runtime.bands import bands_from_bits, decode_heads, encode_heads
from kvfold_runtime.kernels import cpu_bits, dispatch, torch_bits
from kvfold_runtime.kernels.torch_bits import decode_rows, encode_rows
from tests.runtime.test_triton_bits import LAYERS


@pytest.fixture(params=["c", "c-scalar", "compiled", "eager"])
def decoder(request, monkeypatch):
    """Each of the CPU path's decoders: the C one (cpu_bits.c, where a C compiler runs: its vector loops where the
    CPU has AVX2 and BMI2, and built without them), torch_bits' table-driven ops compiled by inductor, and those ops
    eagerly (no compiler at all)."""
    if request.param.startswith("c"):
        monkeypatch.setenv("KVFOLD_CPU_DECODER", request.param)
        if cpu_bits.library() is None:
            assert shutil.which("cc") is None and shutil.which("gcc") is None, "a compiler is here: the build failed"
            pytest.skip("no C compiler on this machine")
    else:
        monkeypatch.setattr(cpu_bits, "library", lambda: None)
    if request.param == "eager":
        monkeypatch.setitem(torch_bits._compiled, "failed", True)
    return request.param


def _decode_cases(g: torch.Generator) -> list:
    cases = [(d.d_k, d.k_bands) for d in LAYERS.values()] + [(d.d_v, d.v_bands) for d in LAYERS.values()]
    return cases + [((13, 64, 7), _random_heads((13, 64, 7), g)) for _ in range(6)]


@pytest.mark.parametrize("lead", [(50,), (3, 17)])
def test_decode_rows_equals_decode_heads(decoder, lead):
    g = torch.Generator().manual_seed(len(lead))
    for widths, bands in _decode_cases(g):
        rows = encode_heads(torch.randn(*lead, sum(widths), generator=g) * 3, widths, bands)
        assert torch.equal(decode_rows(rows, widths, bands, torch.float32),
                           decode_heads(rows, widths, bands, torch.float32))
        assert torch.equal(decode_rows(rows, widths, bands, torch.bfloat16),
                           decode_heads(rows, widths, bands, torch.bfloat16))
        junk = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=g)  # NaN and inf halves included
        want = decode_heads(junk, widths, bands, torch.float32)
        assert torch.equal(decode_rows(junk, widths, bands, torch.float32).nan_to_num(7.0), want.nan_to_num(7.0))
        wide = torch.cat([junk, rows], -1)[..., junk.shape[-1]:]  # a slice of wider rows, as [keys | values] is
        assert torch.equal(decode_rows(wide, widths, bands, torch.float32), decode_heads(rows, widths, bands,
                                                                                         torch.float32))


def test_the_c_decoder_splits_many_rows_over_threads():
    """Rows enough for the OpenMP loop (torch's threads) decode as one thread would; the library uses torch's
    OpenMP runtime (torch's libgomp.so.1), not the system's, which would start a second thread pool."""
    if cpu_bits.library() is None:
        pytest.skip("no C compiler on this machine")
    dims = LAYERS["uneven"]
    rows = encode_heads(torch.randn(3001, sum(dims.d_v)), dims.d_v, dims.v_bands)
    assert torch.equal(decode_rows(rows, dims.d_v, dims.v_bands, torch.float32),
                       decode_heads(rows, dims.d_v, dims.v_bands, torch.float32))
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert not [path for path in gomp if path.startswith(("/usr/", "/lib"))], gomp  # the system's: a second pool


def test_the_c_decoder_uses_its_vector_loops_where_the_cpu_has_them(monkeypatch):
    """The default build decodes with AVX2 + BMI2 vectors wherever the CPU has them (else every test above would
    check only the scalar loops on such a machine); KVFOLD_CPU_DECODER=c-scalar builds the scalar loops."""
    if cpu_bits.library() is None:
        pytest.skip("no C compiler on this machine")
    flags = next((line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    assert cpu_bits.library().kvfold_vector_loops() == int("avx2" in flags and "bmi2" in flags)
    monkeypatch.setenv("KVFOLD_CPU_DECODER", "c-scalar")
    assert cpu_bits.library().kvfold_vector_loops() == 0


def _rows_to_encode(width: int, g: torch.Generator) -> torch.Tensor:
    """Rows spanning 2^±40 per dim, a row of zeros, one with a huge value, one below the smallest log8 scale."""
    x = torch.randn(41, width, generator=g) * torch.logspace(-12, 12, width, base=2.0)
    x[0], x[1, 0], x[2] = 0.0, 1e9, 1e-9
    return x


def _random_heads(widths: tuple[int, ...], g: torch.Generator) -> tuple:
    """Per head, bits drawn from every width incl. 0 (dims past the last band, which no band holds)."""
    choices = torch.tensor([16, 8, 6, 5, 4, 3, 2, 0])
    return tuple(bands_from_bits(sorted(choices[torch.randint(0, 8, (w,), generator=g)].tolist(), reverse=True))
                 for w in widths)


def test_encode_rows_writes_encode_heads_bytes(decoder):
    """The encoder of each CPU path (the `decoder` fixture's: C, C scalar, compiled, eager)."""
    g = torch.Generator().manual_seed(3)
    cases = [(d.d_k, d.k_bands) for d in LAYERS.values()] + [(d.d_v, d.v_bands) for d in LAYERS.values()]
    cases += [((13, 64, 7), _random_heads((13, 64, 7), g)) for _ in range(12)]
    cases += [((512,), (bands_from_bits([8] * 10 + [4] * 290 + [2] * 212),))]  # a band wider than C's 256-dim chunk
    for widths, bands in cases:  # torch's float16-scale sides take encode_heads itself: checked all the same
        x = _rows_to_encode(sum(widths), g)
        assert torch.equal(encode_rows(x, widths, bands), encode_heads(x, widths, bands))
        assert torch.equal(encode_rows(x * 3e-5, widths, bands), encode_heads(x * 3e-5, widths, bands))
        lead = encode_rows(x[:6].view(2, 3, -1), widths, bands)
        assert torch.equal(lead, encode_heads(x[:6], widths, bands).view(2, 3, -1))
        assert torch.equal(encode_rows(x.bfloat16(), widths, bands), encode_heads(x.bfloat16(), widths, bands))


def test_a_steps_plan_is_made_once_and_read_by_every_layer():
    dims = LAYERS["uneven"]
    codec, bs = BandRows(dims), 4
    kv = torch.zeros(12, 1, bs, sum(dims.row_bytes()), dtype=torch.uint8)
    table = torch.arange(1, 11, dtype=torch.int32).view(2, 5)
    lens, starts = torch.tensor([9, 14]), torch.tensor([0, 1, 2])
    slots = torch.cat([table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for r, n in enumerate(lens.tolist())])
    write_paged(kv, slots, torch.randn(23, sum(dims.d_k)), torch.randn(23, sum(dims.d_v)), codec=codec)
    q = torch.randn(2, dims.group * sum(dims.d_k))
    plans = {}
    args = (q, kv, table, lens, starts, list(dims.d_k), list(dims.d_v), dims.group)
    first = dispatch.paged(*args, scaling=0.3, codec=codec, plans=plans)
    assert list(plans) == [(bs, None)]
    made = plans[(bs, None)]
    again = dispatch.paged(*args, scaling=0.3, codec=codec, plans=plans)
    assert plans[(bs, None)] is made and torch.equal(first, again)
    assert torch.equal(first, dispatch.paged(*args, scaling=0.3, codec=codec))  # no plans kept: the same
    dispatch.paged(*args, scaling=0.3, codec=codec, plans=plans, sliding_window=5)
    assert set(plans) == {(bs, None), (bs, 5)}


def test_a_layers_c_arguments_are_kept_while_its_dims_live():
    """cpu_bits keeps a layer's C arguments per LayerDims object (hashing its bands per call was slower than the
    call) — and drops them when that object goes, so layers made and dropped (tests, reloads) leave nothing."""
    if cpu_bits.library() is None:
        pytest.skip("no C compiler on this machine")
    dims = dataclasses.replace(LAYERS["uneven"])  # an object of this test's own
    k, v = torch.randn(5, sum(dims.d_k)), torch.randn(5, sum(dims.d_v))
    rows = cpu_bits.encode_layer_rows_c(k, v, dims)
    assert torch.equal(rows, torch.cat([encode_heads(k, dims.d_k, dims.k_bands),
                                        encode_heads(v, dims.d_v, dims.v_bands)], -1))
    key = (id(dims), torch.uint8)
    assert cpu_bits._layers[key][1] is cpu_bits.layer_args(dims)
    del dims
    gc.collect()
    assert key not in cpu_bits._layers


def test_the_avx2_build_spreads_codes_without_pdep(tmp_path):
    """An AVX2 CPU without AVX-512 gets the eight-code loop built from variable shifts, never BMI2's pdep: AMD
    before Zen 3 runs pdep in microcode (there a SmolLM2 layer's 4K decode took 6.4 ms, the scalar loop 0.86).
    The machine code of the build for such a CPU (x86-64-v3: AVX2 + BMI2) is read back."""
    cc, objdump = shutil.which("gcc"), shutil.which("objdump")
    if cc is None or objdump is None or os.uname().machine != "x86_64":
        pytest.skip("needs gcc and objdump on x86-64")
    built = tmp_path / "avx2.o"
    subprocess.run([cc, "-O3", "-march=x86-64-v3", "-fopenmp", "-c", str(cpu_bits._SOURCE), "-o", str(built)],
                   check=True, capture_output=True, timeout=120)
    code = subprocess.run([objdump, "-d", str(built)], check=True, capture_output=True, text=True).stdout
    assert "vpsrlvq" in code and "pdep" not in code
