"""Host-side pieces the Triton decode and prefill kernels share: the per-head offset table, tile sizes, the
tl.dot precision options, and the checks of queries, masks and paged caches (each raising ValueError with the
fix). The layouts are kvfold_runtime.kernels.paged's; the kernels are triton_decode.py and triton_prefill.py."""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = [
    "MASK_DTYPES",
    "check_paged",
    "check_query",
    "dot_options",
    "head_table",
    "mask_args",
    "mask_problem",
    "program_head",
    "program_task",
    "supports_mask",
    "tile",
    "unit_columns",
]


@functools.lru_cache(maxsize=256)
def _head_table(d_k: tuple[int, ...], d_v: tuple[int, ...], device: str) -> torch.Tensor:
    off_k = [0, *itertools.accumulate(d_k)][:-1]
    off_v = [0, *itertools.accumulate(d_v)][:-1]
    return torch.tensor([off_k, list(d_k), off_v, list(d_v)], dtype=torch.int32, device=device)


def head_table(d_k, d_v, device) -> torch.Tensor:
    """[4, G] int32 rows: key column offset, d_k, value column offset, d_v of each KV head (cached, one
    per width list and device, so a serving step builds nothing on the host)."""
    return _head_table(tuple(int(w) for w in d_k), tuple(int(w) for w in d_v), str(torch.device(device)))


def tile(width: int) -> int:
    """Tile extent covering `width` columns (tl.dot needs at least 16)."""
    return max(16, triton.next_power_of_2(int(width)))


def dot_options(kernel, dtype: torch.dtype) -> dict:
    """The tl.dot constexprs: float32 inputs take full-precision products (the default tf32 would miss the
    float32 contract). Triton's interpreter (TRITON_INTERPRET=1, decided when the kernel was decorated)
    multiplies bfloat16 tiles as their raw uint16 bits, so there they are widened to float32 first: exact
    products with float32 sums, what the GPU's bfloat16 MMA computes too."""
    upcast = dtype == torch.bfloat16 and not isinstance(kernel, JITFunction)
    return {"DOT_PREC": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def check_query(query: torch.Tensor, d_k, d_v, group: int) -> None:
    """ValueError (with the fix) when the widths do not describe the query's packed layout, or the dtype is not
    one the kernels compute in."""
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Triton kernels take float16, bfloat16 or float32, not {query.dtype}: use "
                         "kvfold_runtime.reference_attention or sdpa_attention")
    if query.shape[-1] != group * sum(d_k):
        raise ValueError(f"query width {query.shape[-1]} is not group × Σd_k = {group} × {sum(d_k)}: pass the "
                         "layer's own d_k and group (kvfold_runtime.model_dims)")
    if len(d_k) != len(d_v) or min(*d_k, *d_v) < 1:
        raise ValueError("d_k and d_v need one positive width per KV head")


def unit_columns(x: torch.Tensor) -> torch.Tensor:
    """x with adjacent columns adjacent in memory, as the kernels address them (a copy only if they are not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)


def mask_problem(mask: torch.Tensor, b: int, heads: int, t: int, s: int, device) -> str | None:
    """Why the kernels cannot take `mask` for b sequences × `heads` query heads × t queries × s keys, or None.
    They take kvfold_runtime.kernels.masks' masks: bool (True = attend) or float (added to the scores: 0 or a
    large negative number, float16 / bfloat16 / float32), shaped [B|1, H|1, T|1, ≥S] (keys past S are unused)."""
    if mask.dtype not in MASK_DTYPES:
        return f"a {mask.dtype} mask (the kernels take bool, float16, bfloat16 or float32 masks)"
    if mask.device != torch.device(device):
        return f"a mask on {mask.device}, the query on {device}"
    want = (b, heads, t, s)
    if mask.dim() != 4 or any(n not in (1, w) for n, w in zip(mask.shape[:3], want[:3], strict=True)) \
            or mask.shape[3] < s:
        return f"a mask of shape {tuple(mask.shape)} (want [{b} or 1, {heads} or 1, {t} or 1, ≥ {s}])"
    return None


def supports_mask(mask: torch.Tensor, b: int, heads: int, t: int, s: int, device) -> bool:
    """Whether the kernels take `mask` as it is (see mask_problem)."""
    return mask_problem(mask, b, heads, t, s, device) is None


def mask_args(mask: torch.Tensor, b: int, heads: int, t: int, s: int, device) -> tuple:
    """(tensor, strides over sequence / query head / query / key, boolean?) as the kernels read `mask`: a
    broadcast dimension (size 1) gets stride 0, a bool mask is read as its bytes. ValueError if they cannot."""
    problem = mask_problem(mask, b, heads, t, s, device)
    if problem is not None:
        raise ValueError(f"the Triton kernels cannot take {problem}: use kvfold_runtime.sdpa_attention")
    strides = tuple(0 if n == 1 else st for n, st in zip(mask.shape, mask.stride(), strict=True))
    is_bool = mask.dtype == torch.bool
    return (mask.view(torch.uint8) if is_bool else mask), strides, is_bool


def check_paged(query: torch.Tensor, kv: torch.Tensor, out: torch.Tensor | None) -> None:
    if kv.dtype != query.dtype:
        raise ValueError(f"cache dtype {kv.dtype} is not the query's {query.dtype}: fp8 caches need the torch path "
                         "(kvfold_runtime.kernels.paged_attention)")
    if kv.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("the paged cache and `out` need contiguous rows (stride 1 along the last dimension)")


@triton.jit
def program_task(starts_ptr, NUM_SPLITS: tl.constexpr):
    """A bits kernel program's task (triton_bits, triton_pages): (query block mb, KV head g, context split sp,
    request r, the request's first query token and its query count), from its grid position
    (query blocks, KV heads × splits, requests) and query_start_loc."""
    mb = tl.program_id(0)
    g = tl.program_id(1) // NUM_SPLITS
    sp = tl.program_id(1) % NUM_SPLITS
    r = tl.program_id(2)
    q_start = tl.load(starts_ptr + r).to(tl.int32)
    q_len = tl.load(starts_ptr + r + 1).to(tl.int32) - q_start
    return mb, g, sp, r, q_start, q_len


@triton.jit
def program_head(heads_ptr, num_kv_heads, g):
    """KV head g's (key column offset, d_k, value column offset, d_v) from head_table's [4, G] rows."""
    return (tl.load(heads_ptr + g), tl.load(heads_ptr + num_kv_heads + g), tl.load(heads_ptr + 2 * num_kv_heads + g),
            tl.load(heads_ptr + 3 * num_kv_heads + g))
