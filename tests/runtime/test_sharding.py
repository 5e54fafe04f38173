"""Tensor-parallel sharding of kvfold exports (kvfold_runtime.sharding), without an engine: each rank's tensors,
cut from a real export on disk by the functions the vLLM plugin's weight loaders call, give that rank's heads'
attention exactly, and the ranks' o_proj partial products add up to the unsharded layer's output."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kvfold_runtime import ConfigBlock, LayerDims, reference_attention
from kvfold_runtime.sharding import (
    PAD_LIMIT_ENV,
    check_tensor_parallel,
    padding_fraction,
    post_rope,
    shard_layer,
)
from tests.runtime.conftest import WIDE, WIDE_ARCHS


def _load(export) -> tuple[dict, list[LayerDims]]:
    """An export's tensors (from its files) and its layers' widths."""
    config = json.loads((export.path / "config.json").read_text())
    tensors = {}
    for f in export.path.glob("*.safetensors"):
        tensors |= load_file(f)
    return tensors, ConfigBlock.from_dict(config["kvfold"]).layers(8, 4)


def _attention(x, wq, bq, wk, bk, q_post_cols, k_post_cols, wv, bv, dims: LayerDims, d: int):
    """The packed attention output [T, Σ_h d_v(g(h))] of one layer's heads without RoPE (sharding is per head, and
    RoPE acts within a head): q' = (x W_q) A_h per query head, k' = (x W_k) B_g, v' = x W_v'."""
    def linear(w, b):
        return x @ w.T + (b if b is not None else 0)

    q, k, v = linear(wq, bq), linear(wk, bk), linear(wv, bv)
    q_heads, k_heads = q.split(d, -1), k.split(d, -1)
    q_short = torch.cat([h @ a for h, a in zip(q_heads, q_post_cols, strict=True)], -1)
    k_short = torch.cat([h @ b for h, b in zip(k_heads, k_post_cols, strict=True)], -1)
    return reference_attention(q_short[None], k_short[None], v[None], list(dims.d_k), list(dims.d_v), dims.group,
                               scaling=d**-0.5)[0]


def _blocks(per_head: torch.Tensor, d: int, widths: list[int]) -> list[torch.Tensor]:
    """The per-head [d, w] blocks of a [heads, d, widest] projection (the padding columns checked zero)."""
    assert per_head.shape == (len(widths), d, max(widths))
    for block, w in zip(per_head, widths, strict=True):
        assert not block[:, w:].any()
    return [block[:, :w] for block, w in zip(per_head, widths, strict=True)]


def _rows(tensors: dict, name: str, rows: slice) -> torch.Tensor | None:
    return tensors[name][rows] if name in tensors else None


def _cols(t: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    return list(t.split(widths, -1))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("arch", WIDE_ARCHS)
def test_each_rank_computes_its_heads_and_the_ranks_add_up(wide_exports, arch, size, monkeypatch):
    monkeypatch.setenv(PAD_LIMIT_ENV, "1")  # uneven widths: the ranks pad
    tensors, layers = _load(wide_exports[arch, "uneven"])
    d = 16
    x = torch.randn(12, WIDE["hidden_size"], generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    check_tensor_parallel(layers, size)
    for i, dims in enumerate(layers):
        p = f"model.layers.{i}.self_attn."
        t = {name[len(p):]: w.float() for name, w in tensors.items() if name.startswith(p)}
        q_widths = [w for w in dims.d_k for _ in range(dims.group)]
        full = _attention(x, t["q_proj.weight"], t.get("q_proj.bias"), t["k_proj.weight"], t.get("k_proj.bias"),
                          _cols(t["kvfold_q_post"], q_widths), _cols(t["kvfold_k_post"], list(dims.d_k)),
                          t["v_proj.weight"], t.get("v_proj.bias"), dims, d)
        full_heads = _cols(full, [w for w in dims.d_v for _ in range(dims.group)])
        total = torch.zeros(x.shape[0], WIDE["hidden_size"])
        for rank in range(size):
            shard = shard_layer(dims, rank, size)
            local = shard.dims
            assert shard_layer(dims, size - 1 - rank, size).dims.row_bytes() == local.row_bytes()  # one spec
            qh, kh = shard.query_heads, shard.heads
            rows_q, rows_k = slice(qh.start * d, qh.stop * d), slice(kh.start * d, kh.stop * d)
            local_q_widths = [w for w in local.d_k for _ in range(local.group)]
            v_bias = shard.v_rows(t["v_proj.bias"]) if "v_proj.bias" in t else None
            out = _attention(x, t["q_proj.weight"][rows_q], _rows(t, "q_proj.bias", rows_q),
                             t["k_proj.weight"][rows_k], _rows(t, "k_proj.bias", rows_k),
                             _blocks(shard.q_post(t["kvfold_q_post"]), d, local_q_widths),
                             _blocks(shard.k_post(t["kvfold_k_post"]), d, list(local.d_k)),
                             shard.v_rows(t["v_proj.weight"]), v_bias, local, d)
            # the runtime's batched product (post_rope) packs each head's block product to its width
            xq = torch.randn(5, len(qh) * d)
            torch.testing.assert_close(
                post_rope(xq, shard.q_post(t["kvfold_q_post"]), shard.q_post_columns()),
                torch.cat([h @ a for h, a in zip(xq.split(d, -1), _blocks(shard.q_post(t["kvfold_q_post"]), d,
                                                                          local_q_widths), strict=True)], -1))
            xk = torch.randn(5, len(kh) * d)
            torch.testing.assert_close(
                post_rope(xk, shard.k_post(t["kvfold_k_post"]), shard.k_post_columns()),
                torch.cat([h @ b for h, b in zip(xk.split(d, -1), _blocks(shard.k_post(t["kvfold_k_post"]), d,
                                                                          list(local.d_k)), strict=True)], -1))
            # this rank's query heads equal the unsharded layer's, their padded dims zero
            for h, got in zip(qh, _cols(out, [w for w in local.d_v for _ in range(local.group)]), strict=True):
                want = full_heads[h]
                torch.testing.assert_close(got[:, :want.shape[1]], want, rtol=1e-5, atol=1e-6)
                assert not got[:, want.shape[1]:].any()
            total += out @ shard.o_cols(t["o_proj.weight"]).T
        torch.testing.assert_close(total, full @ t["o_proj.weight"].T, rtol=1e-5, atol=1e-5)


def _dims(d_k, d_v, group=2):
    return LayerDims(tuple(d_k), tuple(d_v), group)


def test_a_rank_pads_its_last_head_to_the_widest_ranks_widths():
    dims = _dims([16, 8, 12, 12], [10, 16, 8, 8])
    shards = [shard_layer(dims, r, 2) for r in range(2)]
    assert [s.dims.d_k for s in shards] == [(16, 8), (12, 12)]  # 24 each: no key padding
    assert [s.dims.d_v for s in shards] == [(10, 16), (8, 18)]  # 26 vs 16: rank 1 pads 10 value dims
    assert [(s.pad_k, s.pad_v) for s in shards] == [(0, 0), (0, 10)]
    assert padding_fraction([dims], 2) == pytest.approx((24 * 2 + 26 * 2) / (48 + 42) - 1)
    assert padding_fraction([_dims([16, 8, 8, 16], [8, 8, 8, 8])], 2) == 0


def test_a_balanced_export_splits_without_padding(wide_exports, monkeypatch):
    monkeypatch.delenv(PAD_LIMIT_ENV, raising=False)
    _, layers = _load(wide_exports["LlamaForCausalLM", "balanced"])
    assert padding_fraction(layers, 2) == 0 and padding_fraction(layers, 4) > 0.03
    check_tensor_parallel(layers, 2)
    with pytest.raises(ValueError, match="--tp 4"):
        check_tensor_parallel(layers, 4)


def test_tensor_parallel_refusals(monkeypatch):
    monkeypatch.delenv(PAD_LIMIT_ENV, raising=False)
    even = [_dims([16, 8, 8, 16], [8, 8, 8, 8])]
    check_tensor_parallel(even, 2)
    check_tensor_parallel(even, 4 // 4)
    with pytest.raises(ValueError, match="4 KV heads do not split over tensor_parallel_size=3"):
        check_tensor_parallel(even, 3)
    uneven = [_dims([16, 8, 12, 12], [10, 16, 8, 8])]
    with pytest.raises(ValueError, match=r"11\.1% more cache .*--tp 2.*KVFOLD_TP_PADDING=0\.111"):
        check_tensor_parallel(uneven, 2)
    with pytest.raises(ValueError, match="balanced for --tp 4"):
        check_tensor_parallel(uneven, 2, balanced_for=4)
    monkeypatch.setenv(PAD_LIMIT_ENV, "0.2")
    check_tensor_parallel(uneven, 2)
    monkeypatch.setenv(PAD_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="KVFOLD_TP_PADDING='lots' is not a number"):
        check_tensor_parallel(uneven, 2)


def test_bits_layers_serve_only_when_their_ranks_hold_equal_bytes():
    from kvfold_runtime import bands_from_bits

    def banded(bits_k, bits_v):
        k = tuple(bands_from_bits(b) for b in bits_k)
        v = tuple(bands_from_bits(b) for b in bits_v)
        return LayerDims(tuple(sum(x > 0 for x in b) for b in bits_k), tuple(sum(x > 0 for x in b) for b in bits_v),
                         2, k, v)

    same = banded([[8, 4, 4, 0], [8, 4, 4, 0]], [[4, 4, 2, 2], [4, 4, 2, 2]])
    check_tensor_parallel([same], 2)
    assert shard_layer(same, 1, 2).dims.k_bands == (same.k_bands[1],)
    other_bytes = banded([[8, 4, 4, 0], [8, 8, 2, 0]], [[4, 4, 2, 2], [4, 4, 2, 2]])  # equal widths, unequal bytes
    for dims in (other_bytes, banded([[8, 4, 4, 0], [8, 4, 0, 0]], [[4, 4, 2, 2], [4, 4, 2, 2]])):
        with pytest.raises(ValueError, match="band rows cannot be padded"):
            check_tensor_parallel([dims], 2)
