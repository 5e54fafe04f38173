"""The CPU codec of band codes in C (cpu_bits.c): decode_heads' values, encode_heads' bytes, and decode attention read
straight from a paged cache's codes; built once per machine with the C compiler inductor also uses, called through
ctypes (no Python extension build, no torch headers: a 2-second compile). Its loops run on torch's own OpenMP
threads: built with -fopenmp, it links libgomp.so.1, which the process has already loaded for torch (one runtime, one
thread pool; Python threads here instead lost their cores to torch's threads spinning after each matmul).

Why C: the table-driven decoder (torch_bits._decode) reads every dim's bytes through index tables, which
inductor compiles to a scalar loop of gathers: 3.1 ms of a 32 × 400-token decode step per SmolLM2 bits layer
call, half of vLLM's whole step on this CPU. Here each band is one loop with its width a constant, eight or
sixteen codes a vector where the CPU has AVX2 + BMI2 (a decode step's attention 0.98 ms there). Where no
compiler runs (or KVFOLD_CPU_DECODER=torch), `library()` is None and torch_bits keeps its own codec.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfold_runtime.bands import FIT_STEPS, Band, log8_scales
from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.bits_table import band_table, unpack

__all__ = ["NUMBER_DTYPES", "STEP_FORMATS", "decode_attention_c", "decode_rows_c", "encode_layer_rows_c",
           "encode_rows_c", "library", "write_layer_slots_c", "write_number_slots_c"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_bits.c")
# -fno-trapping-math: without it GCC keeps floorf scalar (it may not assume the rounding raises no exception), and
# the encoder's fit and codes loops ran one number at a time
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC",
          "-shared"]


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's flags (a shared cache dir may serve several machines)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("KVFOLD_RUNTIME_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvfold-runtime")
    return Path(root)


def library() -> ctypes.CDLL | None:
    """The built decoder, or None (no compiler, a failed build, KVFOLD_CPU_DECODER=torch). KVFOLD_CPU_DECODER=
    c-scalar builds it without its vector loops (AVX2 + BMI2), as on a CPU without them (the tests run both)."""
    choice = os.environ.get("KVFOLD_CPU_DECODER") or "c"
    if choice == "torch" or not sys.platform.startswith("linux"):
        return None
    return _build(("-DKVFOLD_SCALAR",) if choice == "c-scalar" else ())


@functools.cache
def _build(extra: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    flags = [*_FLAGS, *extra]
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    built = _cache_dir() / f"cpu_bits-{key}.so"
    try:
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=built.parent) as tmp:  # built aside, renamed: workers race here
                out = Path(tmp) / built.name
                subprocess.run([cc, *flags, str(_SOURCE), "-o", str(out)], check=True, capture_output=True,
                               timeout=120)
                os.replace(out, built)
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        _log.warning("kvfold: building the C decoder of bits caches failed (%s); decoding in torch (slower)", e)
        return None
    lib.kvfold_decode_attention.restype = ctypes.c_int
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.kvfold_decode_attention.argtypes = [p, p, p, i64, p, i64, i64, i64, p, i64, p, p, i64, i32, i32,
                                            *[p] * 7, ctypes.c_float, p]
    lib.kvfold_vector_loops.restype = ctypes.c_int
    lib.kvfold_encode_slots.restype = None
    lib.kvfold_encode_slots.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kvfold_copy_slots.restype = None
    lib.kvfold_copy_slots.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.kvfold_decode_layer.restype = ctypes.c_int
    lib.kvfold_decode_layer.argtypes = [p, p, i64, p, i64, p, p, i64, p, i64, p, i64, p, p, i64, ctypes.c_float, p,
                                        i32]
    lib.kvfold_decode_rows.restype = None
    lib.kvfold_decode_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


@functools.lru_cache(maxsize=256)
def _head_segments(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                   at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head its segments for cpu_bits.c — per band (out_at, n, bits, code_at, scale_at, scale_kind), zero
    segments for the dims no band holds; out_at from the head's first dim, bytes from the row's start, this
    side's bytes beginning at byte `at` — and where each head's segments start: (segments [M, 6], first [G + 1]).
    Where a band's codes and scale sit is read from bits_table (the layout's one statement, the Triton kernels')."""
    f = unpack(band_table(widths, bands, "cpu"))
    rows, first = [], [0]
    for g, (width, head) in enumerate(zip(widths, bands, strict=True)):
        filled = 0
        for b in head:
            if b.start > filled:
                rows.append((filled, b.start - filled, 0, 0, 0, 0))
            byte, scale_at, kind = (int(f[k][g, b.start]) for k in ("byte", "scale_at", "kind"))
            rows.append((b.start, b.size, b.bits, at + byte, at + scale_at if kind else 0, kind))
            filled = b.start + b.size
        if width > filled:
            rows.append((filled, width - filled, 0, 0, 0, 0))
        first.append(len(rows))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 6), torch.tensor(first, dtype=torch.int32)


@functools.lru_cache(maxsize=256)
def _segments(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """The whole row's segments [M, 6] (decode_rows_c): each head's, out_at moved to the head's first dim."""
    seg, first = _head_segments(widths, bands)
    head_of = torch.repeat_interleave(torch.arange(len(widths)), first.diff())
    starts = torch.tensor([0, *widths]).cumsum(0)[:-1]
    seg = seg.clone()
    seg[:, 0] += starts[head_of].int()
    return seg


@dataclass(frozen=True)
class _Layer:
    """A layer's arguments to cpu_bits.c (a bits layer's bands, or a rank layer's plain numbers), made once per
    LayerDims object and cache dtype: a decode step calls every layer, and hashing a layer's nested bands again on
    each call cost more than the C call itself at batch 1."""

    key_bytes: int
    value_bytes: int
    k_rows: torch.Tensor  # whole-row segments of the keys (encode; none for plain numbers), of the values
    v_rows: torch.Tensor
    k_heads: tuple[torch.Tensor, torch.Tensor]  # per-head segments and each head's first (decode attention)
    v_heads: tuple[torch.Tensor, torch.Tensor]
    d_k: torch.Tensor  # int32
    d_v: torch.Tensor
    log8: torch.Tensor
    out_width: int  # group · Σ d_v: decode attention's output per request


# per (id of a LayerDims, cache dtype): a weak reference to that LayerDims (an id is reused once its object is
# gone, and the entry is dropped then) and its arguments
_layers: dict[tuple[int, torch.dtype], tuple[weakref.ref, _Layer]] = {}

# A rank-format row's numbers as cpu_bits.c reads them: (bits, scale_kind) of one number in the cache's dtype
NUMBER_DTYPES = {torch.float32: (32, 0), torch.float16: (16, 0), torch.bfloat16: (16, 3)}
# A decode step's numbers (q, k, v, out, a ring's rows) as kvfold_decode_layer takes them: its `fmt`
STEP_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _number_heads(widths: tuple[int, ...], offsets: tuple[int, ...], size: int, bits: int, kind: int,
                  at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_head_segments' layout for plain numbers: one segment per head (its first number at `offsets`, from
    LayerDims), its numbers `size` bytes each."""
    rows = [(0, w, bits, at + size * o, 0, kind) for w, o in zip(widths, offsets, strict=True)]
    return (torch.tensor(rows, dtype=torch.int32).reshape(-1, 6),
            torch.arange(len(widths) + 1, dtype=torch.int32))


def layer_args(dims: LayerDims, cache_dtype: torch.dtype = torch.uint8) -> _Layer:
    """The layer's arguments: its band codes (a bits layer, uint8 cache), or its numbers in `cache_dtype` (a
    rank layer: one of NUMBER_DTYPES)."""
    key = (id(dims), cache_dtype)
    hit = _layers.get(key)
    if hit is not None and hit[0]() is dims:
        return hit[1]
    d_k, k_bands, d_v, v_bands = tuple(dims.d_k), tuple(dims.k_bands), tuple(dims.d_v), tuple(dims.v_bands)
    if dims.banded:
        assert cache_dtype == torch.uint8, "a bits layer's cache holds bytes"
        key_bytes, value_bytes = dims.row_bytes()
        k_rows, v_rows = _segments(d_k, k_bands), _segments(d_v, v_bands)
        k_heads, v_heads = _head_segments(d_k, k_bands, 0), _head_segments(d_v, v_bands, key_bytes)
    else:
        size, (bits, kind) = cache_dtype.itemsize, NUMBER_DTYPES[cache_dtype]
        key_bytes, value_bytes = size * sum(d_k), size * sum(d_v)
        k_rows = v_rows = torch.empty(0, 6, dtype=torch.int32)  # nothing to encode: the rows are the numbers
        k_heads = _number_heads(d_k, dims.k_offsets, size, bits, kind, 0)
        v_heads = _number_heads(d_v, dims.v_offsets, size, bits, kind, key_bytes)
    layer = _Layer(key_bytes, value_bytes, k_rows, v_rows, k_heads, v_heads, torch.tensor(d_k, dtype=torch.int32),
                   torch.tensor(d_v, dtype=torch.int32), log8_scales("cpu"), dims.group * sum(d_v))
    _layers[key] = (weakref.ref(dims), layer)
    weakref.finalize(dims, _layers.pop, key, None)
    return layer


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes; None (C's NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def _floats(x: torch.Tensor) -> torch.Tensor:
    """x [N, ...] -> float32 [N, width], unit stride along the width (any row stride)."""
    flat = x.reshape(x.shape[0], -1).float()
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _encode(x: torch.Tensor, segments: torch.Tensor, rows: torch.Tensor) -> None:
    """x [..., Σ widths] -> encode_heads' bytes into rows [N, its row bytes] (uint8, unit stride, any row stride:
    e.g. one half of a wider row)."""
    flat = _floats(x.reshape(-1, x.shape[-1]))
    assert rows.shape[0] == flat.shape[0] and rows.stride(-1) == 1 and rows.dtype == torch.uint8
    library().kvfold_encode_slots(flat.data_ptr(), flat.shape[0], flat.stride(0), segments.data_ptr(),
                                  segments.shape[0], log8_scales("cpu").data_ptr(), FIT_STEPS, rows.data_ptr(),
                                  rows.stride(0), 0, None)


def encode_layer_rows_c(k: torch.Tensor, v: torch.Tensor, dims: LayerDims) -> torch.Tensor:
    """k [N, Σ d_k], v [N, Σ d_v] on the CPU -> a bits layer's rows [N, key bytes + value bytes] uint8 (each
    encode_heads(k) ++ encode_heads(v)), written in place. library() must not be None."""
    lay = layer_args(dims)
    rows = torch.empty(k.shape[0], lay.key_bytes + lay.value_bytes, dtype=torch.uint8)
    _encode(k, lay.k_rows, rows[:, :lay.key_bytes])
    _encode(v, lay.v_rows, rows[:, lay.key_bytes:])
    return rows


def write_layer_slots_c(rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        dims: LayerDims) -> None:
    """A bits layer's paged rows written in place: k [N, Σ d_k], v [N, Σ d_v] on the CPU -> encode_layer_rows_c's
    bytes at rows[slots[i]] (rows [num_slots, row bytes] uint8, contiguous; slots int64, −1: padding, skipped).
    library() must not be None."""
    lib, lay = library(), layer_args(dims)
    assert rows.is_contiguous() and rows.dtype == torch.uint8 and rows.shape[-1] == lay.key_bytes + lay.value_bytes
    slots = slots.to(torch.int64).contiguous()
    for x, segments, at in ((_floats(k), lay.k_rows, 0), (_floats(v), lay.v_rows, lay.key_bytes)):
        assert x.shape[0] == slots.shape[0]
        lib.kvfold_encode_slots(x.data_ptr(), x.shape[0], x.stride(0), segments.data_ptr(), segments.shape[0],
                                lay.log8.data_ptr(), FIT_STEPS, rows.data_ptr(), rows.shape[-1], at, slots.data_ptr())


def write_number_slots_c(rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A rank layer's paged rows written in place: k [N, Σ d_k], v [N, Σ d_v] on the CPU, converted to the cache's
    dtype -> rows[slots[i]] = k[i] ++ v[i] (rows [num_slots, Σ d_k + Σ d_v], contiguous; slots −1: padding,
    skipped): no row made aside and scattered. library() must not be None."""
    lib = library()
    assert rows.is_contiguous() and rows.shape[-1] == k.shape[-1] + v.shape[-1]
    slots, size = slots.to(torch.int64).contiguous(), rows.element_size()
    for x, at in ((k, 0), (v, k.shape[-1] * size)):
        x = x.to(rows.dtype)
        x = x if x.stride(-1) == 1 else x.contiguous()
        assert x.shape[0] == slots.shape[0]
        lib.kvfold_copy_slots(x.data_ptr(), x.shape[0], x.stride(0) * size, x.shape[-1] * size, rows.data_ptr(),
                              rows.shape[-1] * size, at, slots.data_ptr())


def decode_rows_c(rows: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """rows [..., row bytes] uint8 on the CPU -> [..., Σ widths] float32 (decode_heads' values). library() must
    not be None."""
    lib = library()
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    seg = _segments(widths, bands)
    out = torch.empty(flat.shape[0], sum(widths), dtype=torch.float32)
    lib.kvfold_decode_rows(flat.data_ptr(), flat.shape[0], flat.stride(0), seg.data_ptr(), seg.shape[0],
                           log8_scales("cpu").data_ptr(), out.data_ptr(), out.shape[1])
    return out.view(*rows.shape[:-1], out.shape[1])


def encode_rows_c(x: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., Σ widths] on the CPU -> [..., row bytes] uint8 (bands.encode_heads' bytes), written into `out`
    (uint8, its last dim the row's bytes, unit stride: e.g. a column range of a wider row) when given. library()
    must not be None."""
    row_bytes = sum(b.code_bytes + b.scale_bytes for head in bands for b in head)
    if out is None:
        out = torch.empty(*x.shape[:-1], row_bytes, dtype=torch.uint8)
    rows = out if out.dim() == 2 else out.view(-1, out.shape[-1])
    assert rows.shape[-1] == row_bytes
    _encode(x, _segments(widths, bands), rows)
    return out


def decode_attention_c(q: torch.Tensor, blocks: torch.Tensor, block_ids: torch.Tensor, valid: torch.Tensor | None,
                       dims: LayerDims, *, scaling: float, seq_lens: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention read from a layer's paged cache, no decoded copy of it and no gather of its blocks:
    q [N, Σ_h d_k(g(h))], blocks [num_blocks, block_size, C] — a bits layer's uint8 rows of codes (the keys'
    bytes, then the values'), or a rank layer's numbers (float32, float16 or bfloat16: keys, then values) —,
    and which rows each request reads: either block_ids [N, B] its blocks and valid [N, B·block_size] the rows it
    sees (a StepPlan's), or (`seq_lens` [N] given, valid None) block_ids vLLM's block table [N, ≥ its blocks]
    (int32) and every row before seq_lens[n] seen, as in a decode step without a sliding window
    -> [N, Σ_h d_v(g(h))] float32, into `out` when given (float32, contiguous): attention over
    decode_heads' values (or the numbers) up to float32 round-off (torch_decode.packed_decode's contract).
    library() must not be None; group ≤ 64."""
    lib, lay = library(), layer_args(dims, blocks.dtype)
    n = q.shape[0]
    (k_seg, k_first), (v_seg, v_first) = lay.k_heads, lay.v_heads
    row_bytes = lay.key_bytes + lay.value_bytes
    assert blocks.is_contiguous() and blocks.shape[2] * blocks.element_size() == row_bytes
    q = q.float().contiguous()
    if out is None:
        out = q.new_empty(n, lay.out_width)
    assert out.dtype == torch.float32 and out.shape == (n, lay.out_width) and out.is_contiguous()
    # which rows: a plan's blocks and mask, or vLLM's table and lengths (the other pair NULL for C)
    if seq_lens is None:
        ids, valid = block_ids.long().contiguous(), valid.contiguous().view(torch.uint8)
        table = lens = None
    else:
        table, lens = block_ids.to(torch.int32), seq_lens.to(torch.int32).contiguous()
        assert valid is None and table.stride(-1) == 1 and lens.shape[0] == n
        ids = None
    stride = 0 if table is None else table.stride(0)
    failed = lib.kvfold_decode_attention(blocks.data_ptr(), _ptr(ids), _ptr(table), stride, _ptr(lens),
                                         block_ids.shape[1], blocks.shape[1], 0, _ptr(valid),
                                         row_bytes, q.data_ptr(), out.data_ptr(), n, len(dims.d_k), dims.group,
                                         lay.d_k.data_ptr(), lay.d_v.data_ptr(), k_seg.data_ptr(), k_first.data_ptr(),
                                         v_seg.data_ptr(), v_first.data_ptr(), lay.log8.data_ptr(), scaling, None)
    if failed:
        raise MemoryError("kvfold: the C decode attention could not allocate its buffers")
    return out
