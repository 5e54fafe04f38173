"""The CPU decoder of band codes in C (cpu_bits.c): decode_heads' values, built once per machine with the C
compiler inductor also uses, called through ctypes (no Python extension build, no torch headers: a 2-second
compile), the rows split over torch's intra-op threads (ctypes lets go of the GIL during the call).

Why C: the table-driven decoder (torch_bits._decode) reads every dim's bytes through index tables, which
inductor compiles to a scalar loop of gathers: 3.1 ms of a 32 × 400-token decode step per SmolLM2 bits layer
call, half of vLLM's whole step on this CPU. Here each band is one loop with its width a constant. Where no
compiler runs (or KVFOLD_CPU_DECODER=torch), `library()` is None and torch_bits keeps its own decoder.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvfold_runtime.bands import Band

__all__ = ["decode_rows_c", "library"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_bits.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared"]
_MIN_ROWS_PER_THREAD = 256  # below this a thread costs more than it saves


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


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built decoder, or None (no compiler, a failed build, KVFOLD_CPU_DECODER=torch)."""
    if os.environ.get("KVFOLD_CPU_DECODER", "c") == "torch" or not sys.platform.startswith("linux"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    built = _cache_dir() / f"cpu_bits-{key}.so"
    try:
        if not built.exists():
            built.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=built.parent) as tmp:  # built aside, renamed: workers race here
                out = Path(tmp) / built.name
                subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(out)], check=True, capture_output=True,
                               timeout=120)
                os.replace(out, built)
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as e:
        _log.warning("kvfold: building the C decoder of bits caches failed (%s); decoding in torch (slower)", e)
        return None
    lib.kvfold_decode_rows.restype = None
    lib.kvfold_decode_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


@functools.lru_cache(maxsize=256)
def _segments(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """The row's description for cpu_bits.c: per band (out_at, n, bits, code_at, scale_at, scale_kind), and
    zero segments for the dims no band holds."""
    rows, at, out_at = [], 0, 0  # at: the head's first byte; out_at: its first output number
    for width, head in zip(widths, bands, strict=True):
        code_at, scale_at, filled = at, at + sum(b.code_bytes for b in head), 0
        for b in head:
            if b.start > filled:
                rows.append((out_at + filled, b.start - filled, 0, 0, 0, 0))
            kind = {"log8": 1, "float16": 2}[b.scale] if b.scaled else 0
            rows.append((out_at + b.start, b.size, b.bits, code_at, scale_at if b.scaled else 0, kind))
            code_at, scale_at, filled = code_at + b.code_bytes, scale_at + b.scale_bytes, b.start + b.size
        if width > filled:
            rows.append((out_at + filled, width - filled, 0, 0, 0, 0))
        at, out_at = scale_at, out_at + width
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 6)


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvfold-decode")


def decode_rows_c(rows: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                  scales: torch.Tensor) -> torch.Tensor:
    """rows [..., row bytes] uint8 on the CPU -> [..., Σ widths] float32 (decode_heads' values); `scales`: the
    256 log8 scales (bands.log8_scales). library() must not be None."""
    lib = library()
    flat = rows.reshape(-1, rows.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    seg = _segments(widths, bands)
    out = torch.empty(flat.shape[0], sum(widths), dtype=torch.float32)
    n, stride, width = flat.shape[0], flat.stride(0), out.shape[1]

    def run(first: int, count: int) -> None:
        lib.kvfold_decode_rows(flat.data_ptr() + first * stride, count, stride, seg.data_ptr(), seg.shape[0],
                               scales.data_ptr(), out.data_ptr() + first * width * 4, width)

    threads = min(torch.get_num_threads(), n // _MIN_ROWS_PER_THREAD)
    if threads <= 1:
        run(0, n)
    else:
        step = -(-n // threads)
        list(_pool(threads).map(lambda i: run(i, min(step, n - i)), range(0, n, step)))
    return out.view(*rows.shape[:-1], width)
