"""Attention over a *paged* cache of packed per-head widths (vLLM's block tables), in plain torch.

The paged layout — one layout for the vLLM backend, this torch path and the GPU kernels:
  per layer one tensor  kv [num_blocks, block_size, C]  (any leading view of it that flattens to rows,
                         e.g. vLLM's [num_blocks, 1, block_size, C] with one declared "KV head")
  slot of a token        block_table[request, position // block_size] * block_size + position % block_size
  row of a token         its keys then its values, every KV head g at its own width, no padding, stored by
                         the layer's row codec (how the numbers become the row's C elements, and back):
  - NumberRows, rank format: [k'_0 | … | k'_{G-1} | v'_0 | … | v'_{G-1}], C = Σ_g d_k + Σ_g d_v numbers in
    the model's dtype, or fp8 (vLLM's kv_cache_dtype="fp8": uint8 storage holding float8_e4m3fn / e5m2
    codes of k / k_scale and v / v_scale, saturated at the format's largest value), which halves the bytes.
  - BandRows, bits format: uint8, C = LayerDims.row_bytes() = K_bytes + V_bytes, the row
    encode_heads(keys) ++ encode_heads(values) (kvfold_runtime.bands: per head its band codes, then its
    one-byte scales) — exactly the export's bytes per token, the transformers runtime's cache byte for byte.
So a page holds block_size rows: the KV pool shrinks by exactly what the export saves. Attention decodes only
the blocks it reads (those of the requests in the batch), to the query's dtype, then runs the same math for
every codec. Queries and outputs keep the contiguous packed layouts of kvfold_runtime.format
([T, Σ_h d_k(g(h))], [T, Σ_h d_v(g(h))]).

Requests are described as vLLM does: query_start_loc [R + 1] (their query tokens, concatenated), seq_lens [R]
(tokens in the cache after this step, the new ones included: the queries are the *last* tokens of each
sequence), block_table [R, max_blocks]. Decode requests (one query token) are read together, all heads in two
batched products (torch_decode.packed_decode); prefills and chunked prefills (several query tokens against a
cached prefix) go one by one, per KV head (sdpa_attention). What a step's batch reads (StepPlan) is worked out
once per step and KV cache group, not per layer: on a CPU the Python over the batch cost more than the attention.
A step of decodes only with no window needs none where C reads the cache (decode_step_c), and with the step's
rows to write as well it is one C call a layer (decode_layer_c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.cpu_bits import (
    NUMBER_DTYPES,
    decode_attention_c,
    encode_layer_rows_c,
    library,
    write_layer_slots_c,
    write_number_slots_c,
)
from kvfold_runtime.kernels.cpu_step import DecodeLayer
from kvfold_runtime.kernels.torch_bits import decode_rows, encode_rows
from kvfold_runtime.kernels.torch_decode import packed_decode
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention
from kvfold_runtime.pages import PAGE_MULTIPLE, PageLayout, aligned, page_layout

__all__ = ["BandPages", "BandRows", "NumberRows", "RowCodec", "StepPlan", "decode_layer_c", "decode_step_c",
           "paged_attention", "plan_step", "row_codec", "write_paged"]


class RowCodec(Protocol):
    """How a layer's cached row [keys | values] is written and read back."""

    def encode(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        """k [N, Σd_k], v [N, Σd_v] -> rows [N, C] in the cache's dtype."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [..., C] -> keys [..., Σd_k], values [..., Σd_v] in `dtype`."""
        ...


@dataclass(frozen=True)
class NumberRows:
    """Rank format: the numbers themselves, in the cache's dtype (`fp8` None), or float8 codes of k / k_scale
    and v / v_scale (`fp8`: the format the uint8 cache holds)."""

    key_width: int  # Σ_g d_k: where the values start
    fp8: torch.dtype | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    dims: LayerDims | None = None  # the layer's widths, where known: decode attention then reads the rows in C

    def encode(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        if self.fp8 is None:
            return torch.cat([k.to(cache_dtype), v.to(cache_dtype)], -1)
        big = torch.finfo(self.fp8).max
        x = torch.cat([k.float() / self.k_scale, v.float() / self.v_scale], -1)
        return x.clamp(-big, big).to(self.fp8).view(cache_dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.key_width
        if self.fp8 is None:
            return rows[..., :w].to(dtype), rows[..., w:].to(dtype)
        codes = rows.view(self.fp8)
        return codes[..., :w].to(dtype) * self.k_scale, codes[..., w:].to(dtype) * self.v_scale


@dataclass(frozen=True)
class BandRows:
    """Bits format: uint8 rows of the layer's band codes and scales, keys' then values' (kvfold_runtime.bands)."""

    dims: LayerDims

    def encode(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        assert cache_dtype == torch.uint8, "a bits-format layer's cache holds bytes"
        d = self.dims  # encode_heads' bytes: in C where it builds (straight into the row's halves), else table-driven
        if k.device.type == "cpu" and library() is not None:
            return encode_layer_rows_c(k, v, d)
        return torch.cat([encode_rows(k, d.d_k, d.k_bands), encode_rows(v, d.d_v, d.v_bands)], -1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d, key_bytes = self.dims, self.dims.row_bytes()[0]  # decode_rows: decode_heads' values, table-driven
        return (decode_rows(rows[..., :key_bytes], d.d_k, d.k_bands, dtype),
                decode_rows(rows[..., key_bytes:], d.d_v, d.v_bands, dtype))


@dataclass(frozen=True)
class BandPages(BandRows):
    """Bits format in the GPU page layout (kvfold_runtime.pages): each block of the cache is a page, its tokens'
    rows (BandRows' bytes) rearranged so the Triton page kernel (triton_pages.py) reads them with wide loads. Where
    the Triton kernels run and a layer's bands are aligned; the same bytes per token."""

    page: int = 16  # tokens per block

    @property
    def layout(self) -> PageLayout:
        return page_layout(self.dims, self.page)

    def as_rows(self, kv: torch.Tensor) -> torch.Tensor:
        """The cache [num_blocks, …, P, C] with every page turned back into rows (a copy; for the torch path)."""
        blocks = kv.reshape(kv.shape[0], -1)
        return self.layout.to_rows(blocks).reshape(kv.shape)

    def request_rows(self, kv: torch.Tensor, table_row: torch.Tensor, s: int) -> torch.Tensor:
        """The rows [blocks, P, C] of one request's blocks that hold its first s positions (its block-table row
        `table_row`), turned back from pages: a copy of that request's pages only, never the whole cache."""
        blocks = -(-s // self.page)
        return self.layout.to_rows(kv.reshape(kv.shape[0], -1).index_select(0, table_row[:blocks].long()))


def row_codec(dims: LayerDims, fp8: torch.dtype | None = None, k_scale: float = 1.0,
              v_scale: float = 1.0, page: int | None = None) -> NumberRows | BandRows:
    """The codec of a layer's cache: its bands for a bits-format layer, else its numbers (`fp8`: as fp8 codes).
    `page`: the cache's block size where the Triton kernels read it: an aligned bits layer is then stored in the GPU
    page layout (BandPages) when its blocks fit it (a multiple of pages.PAGE_MULTIPLE tokens)."""
    if dims.banded:
        assert fp8 is None, "band codes are not quantized again"
        if page is not None and page % PAGE_MULTIPLE == 0 and aligned(dims):
            return BandPages(dims, page)
        return BandRows(dims)
    return NumberRows(sum(dims.d_k), fp8, k_scale, v_scale, dims)


def write_paged(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                codec: RowCodec | None = None) -> None:
    """Store keys k [N, Σd_k] and values v [N, Σd_v] of N tokens at their slots (-1: padding, skipped), as
    `codec` writes rows (default: the numbers in the cache's dtype)."""
    n = slots.shape[0]
    k, v = k[:n].reshape(n, -1), v[:n].reshape(n, -1)
    codec = codec or NumberRows(k.shape[-1])
    if kv.device.type == "cuda":  # in Triton kernels: a few launches, padding skipped inside, nothing read back
        from kvfold_runtime.kernels import triton_encode

        if isinstance(codec, BandPages):
            return triton_encode.write_pages(kv, slots, k, v, codec.layout)
        return triton_encode.copy_rows(kv, slots, codec.encode(k, v, kv.dtype))
    if not kv.is_contiguous() and not isinstance(codec, BandPages):
        # vLLM's block-outer layouts (a windowed export's): each block a view into a larger one, rows by block
        blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # a view: the rows of a block stay contiguous
        keep = slots >= 0
        slots = slots[keep].long()
        blocks[slots // blocks.shape[1], slots % blocks.shape[1]] = codec.encode(k[keep], v[keep], blocks.dtype)
        return
    rows = kv.view(-1, kv.shape[-1])  # [num_blocks·block_size, C]
    if isinstance(codec, BandPages):  # each token's bytes to their places in its block's page
        keep = slots >= 0
        codec.layout.write(kv, slots[keep], codec.encode(k[keep], v[keep], torch.uint8))
        return
    if k.device.type == "cpu" and slots.device.type == "cpu" and rows.is_contiguous() and library() is not None:
        # straight into the slots, padding skipped in C: no row made aside, no padding check and scatter in torch
        # (their small ops, not the bytes, are what a decode step's write costs on a CPU)
        if isinstance(codec, BandRows):
            return write_layer_slots_c(rows, slots, k, v, codec.dims)
        if isinstance(codec, NumberRows) and codec.fp8 is None:
            return write_number_slots_c(rows, slots, k, v)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    rows[slots] = codec.encode(k, v, rows.dtype)


def _gather(blocks: torch.Tensor, table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows of positions [start, end) of one sequence: [end - start, C]."""
    bs = blocks.shape[1]
    first, last = start // bs, (end + bs - 1) // bs
    rows = blocks.index_select(0, table_row[first:last].long()).reshape(-1, blocks.shape[-1])  # [(last-first)·bs, C]
    return rows[start - first * bs:end - first * bs]


class PrefillAttention(Protocol):
    """Causal attention of a request's last t positions: q [t, Σ group·d_k], its decoded k [S, Σd_k] and
    v [S, Σd_v] -> [t, Σ group·d_v], or None where it does not run."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int],
                 group: int, *, scaling: float) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class StepPlan:
    """How one engine step reads the paged cache, the same for every layer of one block size and window: built
    once per step (vLLM's backend keeps it in the step's metadata), so a layer runs tensor ops only, no Python
    over the batch. Decode requests (one query token) are read together, whole blocks at a time (one
    index_select: ~5× faster on a CPU than gathering single rows): `decode_rows` [N] their query rows,
    `decode_blocks` [N, B] the blocks each reads, from the one holding its first visible token (padded with its
    own last block: a freed block may hold bytes no codec decodes), `decode_valid` [N, B·block_size] which of
    the rows read it sees. `prefills`: per prefill or chunked prefill (request, first query row, query rows,
    tokens in the cache)."""

    decode_rows: torch.Tensor | None
    decode_blocks: torch.Tensor | None
    decode_valid: torch.Tensor | None
    decode_unseen: torch.Tensor | None  # the flat indices of the rows read but not seen, zeroed after the read
    prefills: tuple[tuple[int, int, int, int], ...]


def plan_step(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
              sliding_window: int | None = None) -> StepPlan:
    """The StepPlan of a batch described as vLLM does (see the module docstring)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    prefills = tuple((i, starts[i], q_lens[i], lens[i]) for i in range(len(lens)) if q_lens[i] > 1)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if not decode:
        return StepPlan(None, None, None, None, prefills)
    dev = block_table.device
    seq = torch.tensor([lens[i] for i in decode], device=dev)
    begin = torch.zeros_like(seq) if sliding_window is None else (seq - sliding_window).clamp(min=0)
    first, last = begin // block_size, (seq - 1) // block_size  # the blocks holding visible tokens
    count = int((last - first).max()) + 1
    cols = torch.minimum(first[:, None] + torch.arange(count, device=dev)[None, :], last[:, None])  # [N, B]
    blocks = block_table[torch.tensor(decode, device=dev)].gather(1, cols).long()
    pos = first[:, None] * block_size + torch.arange(count * block_size, device=dev)[None, :]  # position read
    valid = (pos >= begin[:, None]) & (pos < seq[:, None])  # a padded block's positions are all past the end
    rows = torch.tensor([starts[i] for i in decode], device=dev)
    return StepPlan(rows, blocks, valid, (~valid).view(-1).nonzero()[:, 0], prefills)


def _reads_in_c(codec: RowCodec, query: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether decode attention runs in C straight from the blocks (cpu_bits.decode_attention_c): a bits layer's
    codes, or a rank layer's numbers in the model's dtype (not fp8 codes), on a CPU where the library builds."""
    readable = isinstance(codec, BandRows) or (isinstance(codec, NumberRows) and codec.fp8 is None
                                               and codec.dims is not None and blocks.dtype in NUMBER_DTYPES)
    return (readable and query.device.type == "cpu" and codec.dims.group <= 64 and blocks.is_contiguous()
            and library() is not None)


def decode_step_c(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  codec: RowCodec | None, *, scaling: float, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """paged_attention for a step whose every request decodes one token (query row n is request n's) with no
    sliding window, read in C from vLLM's block table and lengths as they are: no StepPlan, which vLLM would
    have the torch path build once per KV cache group and step (one group per distinct page size: 17 on
    SmolLM2's 0.99 bits export, ~0.1 ms each on a CPU). None where C does not read this cache (_reads_in_c)."""
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])
    if codec is None or seq_lens.device.type != "cpu" or not _reads_in_c(codec, query, blocks):
        return None
    n, dims = seq_lens.shape[0], codec.dims
    if out is None:
        out = query.new_empty(query.shape[0], dims.group * sum(dims.d_v))
    direct = out.dtype == torch.float32 and out.is_contiguous()  # written in place, else converted after
    got = decode_attention_c(query[:n], blocks, block_table[:n], None, dims, scaling=scaling, seq_lens=seq_lens,
                             out=out[:n] if direct else None)
    if not direct:
        out[:n] = got.to(out.dtype)
    return out


def decode_layer_c(dims: LayerDims, kv: torch.Tensor, fp8: torch.dtype | None) -> DecodeLayer | None:
    """The layer's decode step as one C call (cpu_step.DecodeLayer: write_paged, then decode_step_c), for its
    cache kv [num_blocks, …, block_size, C]; None where C does not run it: no library, a cache off the CPU or not
    contiguous, fp8 codes, a group over 64."""
    codec = row_codec(dims, fp8)
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])
    query = blocks.new_empty(0)  # what _reads_in_c asks of the query: a CPU one
    # one block's rows contiguous is enough: DecodeLayer takes the blocks any stride apart (block-outer layouts)
    if not _reads_in_c(codec, query, blocks[:1]):
        return None
    return DecodeLayer(dims, blocks.dtype, blocks.shape[1])


def paged_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                    sliding_window: int | None = None, out: torch.Tensor | None = None,
                    codec: RowCodec | None = None, plan: StepPlan | None = None,
                    prefill: PrefillAttention | None = None) -> torch.Tensor:
    """query [T, Σ_h d_k(g(h))] -> [T, Σ_h d_v(g(h))]: causal attention of each request's queries over its
    cached tokens (the paged layout above), at the original model's scaling. `sliding_window` W: a query at
    position i sees keys i − W + 1 … i (Mistral's and transformers' convention). `codec`: how the rows were
    written (write_paged; default: the numbers in the cache's dtype). `plan`: plan_step's for this batch, block
    size and window (built here when not given). `prefill`: a faster attention for a prefill's decoded keys and
    values without a window (vLLM's CPU kernel: kvfold_runtime.vllm.cpu_prefill), SDPA where it gives None."""
    codec = codec or NumberRows(sum(d_k))
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # [num_blocks, block_size, C] (vLLM's has a 1 in between)
    if plan is None:
        plan = plan_step(block_table, seq_lens, query_start_loc, blocks.shape[1], sliding_window)
    if out is None:
        out = query.new_empty(query.shape[0], group * sum(d_v))
    if plan.decode_rows is not None:
        if _reads_in_c(codec, query, blocks):  # C: scores and sums straight from the blocks, in place
            out[plan.decode_rows] = decode_attention_c(query[plan.decode_rows], blocks, plan.decode_blocks,
                                                       plan.decode_valid, codec.dims, scaling=scaling).to(out.dtype)
        else:
            n, count = plan.decode_blocks.shape
            rows = blocks.index_select(0, plan.decode_blocks.view(-1)).view(n, count * blocks.shape[1], -1)
            rows.view(-1, rows.shape[-1])[plan.decode_unseen] = 0  # unwritten rows (NaN bytes?): 0 · NaN is NaN
            k, v = codec.decode(rows, query.dtype)
            out[plan.decode_rows] = packed_decode(query[plan.decode_rows], k, v, plan.decode_valid, d_k, d_v, group,
                                                  scaling=scaling)
    for i, first, t, s in plan.prefills:
        begin = 0 if sliding_window is None else max(0, s - t - sliding_window + 1)
        rows = _gather(blocks, block_table[i], begin, s)  # [S', C]
        q = query[first:first + t]
        mask = None  # no window: sdpa_attention's own causal mask, aligned to the last query
        if sliding_window is not None:
            qpos = torch.arange(s - t, s, device=q.device)[:, None]
            kpos = torch.arange(begin, s, device=q.device)[None, :]
            mask = ((kpos <= qpos) & (qpos - kpos < sliding_window))[None, None]  # [1, 1, t, S']
        k, v = codec.decode(rows, q.dtype)
        o = None if prefill is None or mask is not None else prefill(q, k, v, d_k, d_v, group, scaling=scaling)
        if o is None:
            o = sdpa_attention(q[None], k[None], v[None], d_k, d_v, group, scaling=scaling, mask=mask)[0]
        out[first:first + t] = o
    return out
