"""How a kvfold layer splits over tensor-parallel ranks: by KV head, as vLLM's own Llama splits its heads.

Rank r of `size` holds KV heads [r·G/size, (r+1)·G/size) and query heads [r·H/size, (r+1)·H/size): query head h
reads KV head h // group, so a rank's query heads read only its own KV heads and its attention is the
unsharded layer's restricted to those heads. Its tensors (row vectors, format.py's packed layouts):
  q_proj, k_proj      the full-width rows of its heads (vLLM's own column split: heads are head_dim wide)
  kvfold_q_post/k_post  its heads' blocks, one per head ([local heads, d, widest local width], zero-padded)
  v_proj (and bias)   the rows of its KV heads' values
  o_proj              the columns of its query heads' outputs (vLLM adds the ranks' partial sums)

vLLM needs every rank's KV cache spec for a layer to be the same (get_kv_cache_configs in
vllm/v1/core/kv_cache_utils.py asserts it, then gives every rank the smallest rank's block count). With
per-head widths the ranks' shares differ, so each rank declares the widest shard's key and value widths and
a lighter rank widens its last KV head by zero dims: zero columns of the post-RoPE projections (its keys'
extra dims are 0, adding 0 to every score), zero rows of v_proj (extra value dims 0) and zero columns of
o_proj — the same attention, at the padded bytes' cost. `kvfold export --tp N` balances the widths so that no
rank pads at tensor-parallel size N. A bits-format layer's bands cannot be widened this way: its ranks must
hold equal widths and bytes already.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvfold_runtime.format import LayerDims

__all__ = ["PAD_LIMIT", "PAD_LIMIT_ENV", "LayerShard", "check_tensor_parallel", "padding_fraction", "post_rope",
           "shard_layer"]

# The most padding (extra cache bytes ÷ the export's) a TP size may cost before the plugin refuses it: the
# ranks' block pools are then within ~3% of an even split of the export's bytes. A user who accepts more sets
# KVFOLD_TP_PADDING (a fraction) in the serving environment.
PAD_LIMIT = 0.03
PAD_LIMIT_ENV = "KVFOLD_TP_PADDING"


def _split(n: int, rank: int, size: int) -> range:
    per = n // size
    return range(rank * per, (rank + 1) * per)


def post_rope(x: torch.Tensor, blocks: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
    """x [T, heads · d] -> [T, Σ widths]: each head's d numbers times its block [d, widest] (q_post / k_post),
    packed to the heads' widths (q_post_columns / k_post_columns). One batched product: a block-diagonal matmul
    would do `heads` times the work."""
    y = torch.bmm(x.view(x.shape[0], blocks.shape[0], blocks.shape[1]).transpose(0, 1), blocks)  # [heads, T, widest]
    y = y.transpose(0, 1).reshape(x.shape[0], -1)
    return y if columns is None else y.index_select(1, columns)


def _packed_columns(widths: list[int]) -> torch.Tensor | None:
    widest = max(widths)
    if all(w == widest for w in widths):
        return None
    return torch.cat([torch.arange(i * widest, i * widest + w) for i, w in enumerate(widths)])


def _segments(widths: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(start, width) of each head's columns in a packed layout."""
    out, col = [], 0
    for w in widths:
        out.append((col, w))
        col += w
    return out


@dataclass(frozen=True)
class LayerShard:
    """One rank's part of a layer: its KV heads (`heads`, of the unsharded layer `source`) at their widths, the
    last widened by `pad_k` / `pad_v` zero dims (`dims`: what the rank's attention and cache declare)."""

    source: LayerDims
    heads: range
    dims: LayerDims
    pad_k: int
    pad_v: int

    @property
    def query_heads(self) -> range:
        g = self.source.group
        return range(self.heads.start * g, self.heads.stop * g)

    def _query_widths(self, widths: tuple[int, ...]) -> list[int]:
        return [w for w in widths for _ in range(self.source.group)]

    def _take(self, tensor: torch.Tensor, all_widths: list[int], picked: range, new_widths: list[int],
              dim: int) -> torch.Tensor:
        """The segments `picked` of `tensor`'s packed dimension `dim` (one per head, `all_widths`), each placed at
        the start of a segment of `new_widths` (the rest zero)."""
        segs, src = _segments(new_widths), _segments(all_widths)
        shape = list(tensor.shape)
        shape[dim] = sum(new_widths)
        out = tensor.new_zeros(shape)
        for (start, _), h in zip(segs, picked, strict=True):
            s, w = src[h]
            out.narrow(dim, start, w).copy_(tensor.narrow(dim, s, w))
        return out

    def q_post(self, q_post: torch.Tensor) -> torch.Tensor:
        """The checkpoint's kvfold_q_post [d, Σ_h d_k(g(h))] -> this rank's query heads' blocks
        [local query heads, d, widest local width] (a narrower head's block zero-padded on the right)."""
        return self._per_head(q_post, self._query_widths(self.source.d_k), self.query_heads,
                              self._query_widths(self.dims.d_k))

    def k_post(self, k_post: torch.Tensor) -> torch.Tensor:
        """kvfold_k_post [d, Σ_g d_k] -> [local KV heads, d, widest local d_k], one block per head."""
        return self._per_head(k_post, list(self.source.d_k), self.heads, list(self.dims.d_k))

    def q_post_columns(self) -> torch.Tensor | None:
        """Where the packed [T, Σ local query widths] come from in the flat per-head product [T, heads · widest]
        (None: every width is the widest, the product is already packed)."""
        return _packed_columns(self._query_widths(self.dims.d_k))

    def k_post_columns(self) -> torch.Tensor | None:
        return _packed_columns(list(self.dims.d_k))

    def _per_head(self, w: torch.Tensor, all_widths: list[int], picked: range,
                  new_widths: list[int]) -> torch.Tensor:
        out = w.new_zeros(len(new_widths), w.shape[0], max(new_widths))
        src = _segments(all_widths)
        for i, h in enumerate(picked):
            s, width = src[h]
            out[i, :, :width] = w[:, s:s + width]
        return out

    def v_rows(self, v: torch.Tensor) -> torch.Tensor:
        """v_proj's weight [Σ_g d_v, hidden] or bias [Σ_g d_v] -> this rank's [Σ local d_v (padded), …]."""
        return self._take(v, list(self.source.d_v), self.heads, list(self.dims.d_v), 0)

    def o_cols(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj's weight [hidden, Σ_h d_v(g(h))] -> this rank's columns [hidden, Σ local query heads' d_v]."""
        return self._take(o, self._query_widths(self.source.d_v), self.query_heads,
                          self._query_widths(self.dims.d_v), 1)


def _shares(dims: LayerDims, size: int) -> list[tuple[int, int]]:
    """(Σ d_k, Σ d_v) of each rank's KV heads."""
    ranks = [_split(dims.num_kv_heads, r, size) for r in range(size)]
    return [(sum(dims.d_k[g] for g in heads), sum(dims.d_v[g] for g in heads)) for heads in ranks]


def shard_layer(dims: LayerDims, rank: int, size: int) -> LayerShard:
    """Rank `rank`'s part of a layer at tensor-parallel size `size` (check_tensor_parallel says whether it serves)."""
    heads = _split(dims.num_kv_heads, rank, size)
    shares = _shares(dims, size)
    pad_k = max(k for k, _ in shares) - shares[rank][0]
    pad_v = max(v for _, v in shares) - shares[rank][1]
    d_k = [dims.d_k[g] for g in heads]
    d_v = [dims.d_v[g] for g in heads]
    d_k[-1] += pad_k
    d_v[-1] += pad_v
    bands = ()
    if dims.banded:
        assert not (pad_k or pad_v), "check_tensor_parallel refuses bits layers whose ranks differ"
        bands = (tuple(dims.k_bands[g] for g in heads), tuple(dims.v_bands[g] for g in heads))
    local = LayerDims(tuple(d_k), tuple(d_v), dims.group, *bands)
    return LayerShard(dims, heads, local, pad_k, pad_v)


def padding_fraction(layers: list[LayerDims], size: int) -> float:
    """The cache bytes padding adds at tensor-parallel size `size`, over the export's own (rank format)."""
    padded = sum(max(k for k, _ in _shares(d, size)) * size + max(v for _, v in _shares(d, size)) * size
                 for d in layers)
    real = sum(sum(d.d_k) + sum(d.d_v) for d in layers)
    return padded / real - 1.0


def check_tensor_parallel(layers: list[LayerDims], size: int, balanced_for: int | None = None) -> None:
    """ValueError (the fix in its message) unless an export with these layers serves at tensor-parallel size
    `size`: its KV heads split evenly, its ranks' pages differ by at most PAD_LIMIT (rank format: padded) or not
    at all (bits format). `balanced_for`: the size the export balanced its widths for (its manifest), if any."""
    if size == 1:
        return
    kv_heads = layers[0].num_kv_heads
    if kv_heads % size:
        raise ValueError(f"kvfold shards attention by KV head: this model's {kv_heads} KV heads do not split over "
                         f"tensor_parallel_size={size}; use a size that divides {kv_heads} (and pipeline parallelism, "
                         "--pipeline-parallel-size, for more devices)")
    fix = f"re-export it with `kvfold export ... --tp {size}` (balances every rank's widths)"
    if balanced_for:
        fix += f"; this export was balanced for --tp {balanced_for}"
    for i, d in enumerate(layers):
        if not d.banded:
            continue
        shares = _shares(d, size)  # equal shares: shard_layer pads nothing, each rank's rows are its own heads'
        if len(set(shares)) > 1 or len({sum(shard_layer(d, r, size).dims.row_bytes()) for r in range(size)}) > 1:
            raise ValueError(f"layer {i} of this bits-format export holds different widths or bytes on the {size} "
                             f"tensor-parallel ranks (Σd_k, Σd_v per rank: {shares}), and band rows cannot be padded: "
                             "serve it with tensor_parallel_size=1 (and --pipeline-parallel-size), or export the "
                             "rank format")
    waste, limit = padding_fraction(layers, size), _pad_limit()
    if waste > limit:
        raise ValueError(f"at tensor_parallel_size={size} this export's ranks hold uneven widths: padding them "
                         f"would cost {waste:.1%} more cache (the limit is {limit:.0%}); {fix}, or accept the "
                         f"padding: {PAD_LIMIT_ENV}={waste:.3f}")


def _pad_limit() -> float:
    raw = os.environ.get(PAD_LIMIT_ENV)
    if raw is None:
        return PAD_LIMIT
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{PAD_LIMIT_ENV}={raw!r} is not a number: set it to the padding you accept, a fraction of "
                         f"the cache (default {PAD_LIMIT})") from None

