"""The turboquant_* frontier methods against vLLM 0.32's own TurboQuant code: the bytes its store kernel writes into
a paged cache (equal, slot for slot), its bulk dequant and decode attention kernels reading them back, its page size
per token, its boundary layers and its tables (Hadamard matrix, Lloyd-Max centroids and midpoints). These are the
alarm when a vLLM upgrade changes TurboQuant: a failure means the methods no longer model what vLLM serves.

vLLM's kernels are Triton. Its CPU build hands out placeholders for them (vllm.triton_utils: "Triton is installed,
but doesn't include CPU backend"), so the kernel tests execute vLLM's own module files afresh with the real triton
in vllm.triton_utils' place, in Triton's interpreter (a child process started with TRITON_INTERPRET=1, which must be
set before triton is first imported: see tests/runtime/test_triton.py). One interpreter conversion is not the GPU's
and is replaced (_gpu_fp8_cast).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvfold_bench.frontier.methods.turboquant import (
    PRESETS,
    TurboQuant,
    boundary_layers,
    decode_keys,
    decode_values,
    encode_keys,
    encode_values,
    hadamard,
    lloyd_max,
    pack_slot,
    slot_bytes,
    turboquant_roundtrip,
)
from tests.bench.conftest import frontier_logits
from tests.conftest import rerun_in_triton_interpreter

DTYPES = list(PRESETS)
NEEDS_CHILD = os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="run in Triton's interpreter by test_vllm_kernels_in_the_interpreter")
OPS = "vllm.v1.attention.ops."
# vLLM's modules in import order: each later one imports from the earlier ones
KERNEL_MODULES = ("triton_decode_attention", "triton_turboquant_decode", "triton_turboquant_store")


@pytest.mark.vllm
@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_vllm_kernels_in_the_interpreter():
    out = rerun_in_triton_interpreter(__file__, "-m", "vllm", "-k", "vllms_store or vllms_reads")
    assert " passed" in out and "skipped" not in out, out[-2000:]


def _gpu_fp8_cast(convert):
    """The interpreter converts float32 to float8 with its own bit arithmetic: it rounds ties up (17 -> 18, not
    16), drops the carry of a mantissa that rounds up to 2 (1.9375 -> 1), clips the exponent instead of saturating
    (1000 -> 256) and truncates subnormals.
    The GPU's cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even and saturates at ±448, as torch's cast of the
    clamped value does; only that conversion is replaced."""
    import numpy as np
    import triton.language as tl

    def cast(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return convert(data, src, dst, rounding)

    return cast


@pytest.fixture(scope="module")
def vllm_ops():
    """vLLM's kernel modules, executed from their own files with the real triton as vllm.triton_utils. The copies
    stay out of sys.modules (vLLM's own imports keep their placeholders)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    importlib.import_module("vllm.platforms")  # what they import besides triton, imported as vLLM imports it
    importlib.import_module(OPS.rstrip("."))
    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl = triton, tl
    names = ["vllm.triton_utils", *(OPS + m for m in KERNEL_MODULES)]
    saved = {n: sys.modules.get(n) for n in names}
    ops = {}
    try:
        sys.modules["vllm.triton_utils"] = shim
        for m in KERNEL_MODULES:
            spec = importlib.util.find_spec(OPS + m)
            ops[m] = importlib.util.module_from_spec(spec)
            sys.modules[OPS + m] = ops[m]  # the next module's `from ... import` finds this copy
            spec.loader.exec_module(ops[m])
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
    convert = interpreter._convert_float
    interpreter._convert_float = _gpu_fp8_cast(convert)
    yield SimpleNamespace(**ops)
    interpreter._convert_float = convert


def _vllm_layer(dtype: str, d: int):
    """(config, layer): the layer holding the rotation, centroids and midpoints as vLLM's attention backend derives
    them (TurboQuantAttentionImpl._ensure_on_device, on a bare impl)."""
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    config = TurboQuantConfig.from_cache_dtype(dtype, d)
    impl = object.__new__(TurboQuantAttentionImpl)
    impl._soa_store, impl.head_size, impl.tq_config = False, d, config
    layer = torch.nn.Module()
    TurboQuantAttentionImpl._ensure_on_device(impl, layer, "cpu")
    return config, layer


BLOCK, TOKENS, HEADS = 16, 20, 2
BLOCK_TABLE = torch.tensor([[2, 0]], dtype=torch.int32)  # tokens 0-15 in block 2, 16-19 in block 0; block 1 unused


def _kv(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, d] float16 keys and values as a model caches them, with outliers: a few channels 30× (keys reach
    ~100, past float8's 448 in one entry), one token 0.01×. And edges: a zero key (its rotation sits on the middle
    midpoint, 0, and only the 1e-8 keeps it finite), a constant value vector (its scale floors at 1e-8), one whose
    4-bit codes are all ties (0, 0.5, ..., 15 at scale 1: the kernel rounds them up, not to even)."""
    g = torch.Generator().manual_seed(d)
    k, v = torch.randn(2, TOKENS, HEADS, d, generator=g)
    k[..., [1, 7, d - 3]] *= 30
    k[3] *= 0.01
    k[4, 0] = 0.0
    k[5, 1, 2] = 600.0
    v[..., [0, d // 2]] *= 20
    v[8, 0] = 0.25
    v[9, 1] = (torch.arange(d) % 31) / 2
    return k.half(), v.half()


def _store(ops, dtype: str, d: int):
    """vLLM's store into a zeroed cache [blocks, BLOCK, H, slot] as _store_kv calls it -> (cache, config, layer)."""
    config, layer = _vllm_layer(dtype, d)
    k, v = _kv(d)
    cache = torch.zeros(3, BLOCK, HEADS, config.slot_size_aligned, dtype=torch.uint8)
    t = torch.arange(TOKENS)
    slots = (BLOCK_TABLE[0, t // BLOCK] * BLOCK + t % BLOCK).to(torch.int32)
    ops.triton_turboquant_store.triton_turboquant_store(
        k, v, cache, slots, layer._tq_PiT, layer._tq_midpoints, mse_bits=config.key_mse_bits,
        key_packed_size=config.key_packed_size, value_quant_bits=config.effective_value_quant_bits,
        key_fp8=config.key_fp8)
    return cache, config, layer


@pytest.mark.vllm
@kernels
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vllms_store_writes_our_bytes(vllm_ops, dtype, d):
    """Every byte of the paged cache: codes, float16 norms, scales and zeros, padding, and the slots left alone."""
    cache, _, _ = _store(vllm_ops, dtype, d)
    k, v = _kv(d)
    ours = torch.zeros_like(cache)
    t = torch.arange(TOKENS)
    ours[BLOCK_TABLE[0, t // BLOCK].long(), t % BLOCK] = pack_slot(k, v, dtype)
    assert torch.equal(cache, ours)


@pytest.mark.vllm
@kernels
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vllms_reads_are_our_dequantized_values(vllm_ops, dtype, d):
    """Both of vLLM's reads of the cache its store wrote:

    - _tq_full_dequant_kv (continuation prefill) writes float16 keys, in the Hadamard basis for quantized keys, and
      values. Values are bit-equal (code · scale16 + zero16 has no reduction); keys within float32 round-off before
      the float16 rounding, as the norm correction's sum of squares is summed in another order.
    - the decode attention kernel (stage 1 + 2, GQA group 2, two pages, a shorter second sequence) equals attention
      over our original-basis keys and values, within float32 round-off (it scores rotated queries, splits the
      context in 4 and sums in another order)."""
    ops = vllm_ops
    cache, config, layer = _store(ops, dtype, d)
    k, v = _kv(d)
    keys, values = encode_keys(k, dtype), encode_values(v, dtype)

    # launched as _continuation_prefill launches it, over whole blocks
    length = TOKENS + (-TOKENS) % BLOCK
    k_out = torch.zeros(1, HEADS, length, d, dtype=torch.float16)
    v_out = torch.zeros_like(k_out)
    vqb = config.effective_value_quant_bits
    ops.triton_turboquant_decode._tq_full_dequant_kv[(length, HEADS)](
        cache, BLOCK_TABLE, layer._tq_centroids, k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3],
        *cache.stride()[:3], BLOCK_TABLE.stride(0), HEAD_DIM=d, BLOCK_SIZE=BLOCK, NUM_KV_HEADS=HEADS,
        MSE_BYTES=d if config.key_fp8 else math.ceil(d * config.key_mse_bits / 8), KPS=config.key_packed_size,
        VQB=vqb, VAL_DATA_BYTES=math.ceil(d * vqb / 8), MSE_BITS=config.key_mse_bits, KEY_FP8=int(config.key_fp8),
        BLOCK_D=d, NORM_CORRECTION=int(config.norm_correction),
        FP8_E4B15=ops.triton_turboquant_decode._use_fp8_e4b15(0))
    k_read, v_read = k_out[0, :, :TOKENS].transpose(0, 1), v_out[0, :, :TOKENS].transpose(0, 1)  # [N, H, d]
    assert torch.equal(v_read, decode_values(values).half())
    k_ours = decode_keys(keys, dtype, rotated=True)
    if config.key_fp8:
        assert torch.equal(k_read, k_ours.half())
    else:
        # ≤ ½ float16 ulp (bit-equal when measured, 2026-11-25)
        assert torch.all((k_read.float() - k_ours).abs() <= k_ours.abs() * 2**-11 + 1e-6)

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2 * HEADS, d, generator=g)  # [B, Hq, d] float32: no output rounding to compare through
    seq_lens = torch.tensor([TOKENS, 11], dtype=torch.int32)
    scale = d**-0.5
    got = ops.triton_turboquant_decode.triton_turboquant_decode_attention(
        q, cache, BLOCK_TABLE.expand(2, -1).contiguous(), seq_lens, layer._tq_Pi, layer._tq_centroids, scale,
        mse_bits=config.key_mse_bits, key_packed_size=config.key_packed_size,
        value_quant_bits=config.effective_value_quant_bits, key_fp8=config.key_fp8,
        norm_correction=config.norm_correction, PiT=layer._tq_PiT, max_num_kv_splits=4)
    kk = turboquant_roundtrip(k.float().transpose(0, 1), dtype, True).double()  # [H, N, d]
    vv = turboquant_roundtrip(v.float().transpose(0, 1), dtype, False).double()
    for b, n in enumerate(seq_lens.tolist()):
        qb = q[b].double().unflatten(0, (HEADS, 2))  # [H, group, d]
        p = torch.softmax(qb @ kk[:, :n].transpose(1, 2) * scale, -1)
        want = (p @ vv[:, :n]).flatten(0, 1)
        assert torch.allclose(got[b].double(), want, rtol=0, atol=2e-5 * float(want.abs().max()))


@pytest.mark.vllm
@pytest.mark.parametrize("d", [16, 64, 128])
def test_tables_are_vllms(d):
    """The rotation vLLM's backend builds and the centroids and midpoints it stores on each layer."""
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    assert torch.equal(hadamard(d), _build_hadamard(d, "cpu"))
    for dtype, (key_bits, _) in PRESETS.items():
        _, layer = _vllm_layer(dtype, d)
        if key_bits != 8:
            centroids, midpoints = lloyd_max(d, key_bits)
            assert torch.equal(centroids, layer._tq_centroids) and torch.equal(midpoints, layer._tq_midpoints)


def _model_config(layers: int):
    """What get_boundary_skip_layers reads of vLLM's ModelConfig, for a dense model."""
    return SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=layers))


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_per_token_are_vllms_pages(dtype):
    """Per layer: the slot is the page per token and head that vLLM's worker builds (the backend's spec);
    per model (SmolLM2-135M's shape: 30 layers, 3 KV heads, head_dim 64): the fraction is the page of all layers,
    boundary layers at float16, over the float16 page."""
    from transformers import LlamaConfig
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS, TurboQuantConfig
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs, get_kv_quant_mode
    from vllm.v1.worker.utils import customize_attention_spec

    preset = TQ_PRESETS[dtype]
    assert PRESETS[dtype] == (preset["key_quant_bits"], preset["value_quant_bits"])
    assert preset["norm_correction"] == (preset["key_quant_bits"] != 8)

    def page(d, cache_dtype):  # as the attention layer builds its spec; "auto": a boundary layer, bfloat16 model
        torch_dtype = kv_cache_dtype_str_to_dtype(cache_dtype, SimpleNamespace(dtype=torch.bfloat16))
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=d, dtype=torch_dtype,
                                 kv_quant_mode=get_kv_quant_mode(cache_dtype))
        return customize_attention_spec(TurboQuantAttentionBackend, spec)

    for d in (64, 128):
        assert slot_bytes(dtype, d) == TurboQuantConfig.from_cache_dtype(dtype, d).slot_size_aligned
        assert page(d, dtype).page_size_bytes == BLOCK * 3 * slot_bytes(dtype, d)

    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    smollm2 = SimpleNamespace(model=SimpleNamespace(config=config),
                              adapter=SimpleNamespace(attention_modules=lambda model: [None] * 30))
    (cand,) = TurboQuant(dtype).candidates(smollm2)
    kept = {int(i) for i in TurboQuantConfig.get_boundary_skip_layers(_model_config(30))}
    pool = UniformTypeKVCacheSpecs.from_specs({str(i): page(64, "auto" if i in kept else dtype) for i in range(30)})
    assert cand.kv_fraction == pool.page_size_bytes / (30 * page(64, "auto").page_size_bytes)
    assert sorted(cand.patches) == sorted(set(range(30)) - kept)


@pytest.mark.vllm
@pytest.mark.parametrize("layers", [1, 2, 3, 5, 28, 30])
def test_boundary_layers_are_vllms(layers):
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    assert boundary_layers(layers) == [int(i) for i in TurboQuantConfig.get_boundary_skip_layers(_model_config(layers))]


def test_turboquant_candidates_run_on_the_tiny_model(setup):
    """The tiny model's 2 layers are both boundary layers, so vLLM keeps them at 16 bits: nothing changes. Without
    the boundary every layer is quantized: the slot's bytes, and logits moved, the fewer bits the more."""
    pytest.importorskip("vllm.model_executor.layers.quantization.turboquant.centroids")
    d = setup.model.config.head_dim
    ref, err = frontier_logits(setup), {}
    for dtype in DTYPES:
        method = TurboQuant(dtype)
        (cand,) = method.candidates(setup)
        assert method.name == dtype and cand.kv_fraction == 1.0 and not cand.patches
        (cand,) = replace(method, boundary=0).candidates(setup)
        assert cand.kv_fraction == slot_bytes(dtype, d) / (4 * d) and sorted(cand.patches) == [0, 1]
        err[dtype] = float((frontier_logits(setup, cand.patches) - ref).abs().max() / ref.abs().max())
    # measured 2026-11-25: k8v4 0.18, 4bit_nc 0.29, k3v4_nc 0.30, 3bit_nc 0.57 of the largest logit (fp8: 0.10)
    assert 0 < err["turboquant_k8v4"] < err["turboquant_3bit_nc"] < 1, err
