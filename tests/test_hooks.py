"""Acceptance 2: the statistics are right, for every adapter."""

import pytest
import torch

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.calib.run import collect
from kvfold.calib.sinks import GramSink, RecordSink
from kvfold.calib.spectrum import svd_from_gram
from kvfold.calib.tokens import random_sequences
from kvfold.hooks import tapped
from tests.conftest import ROPE_ARCHS, TINY_CONFIGS, VOCAB, build_tiny


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def arch_model(request):
    return request.param, build_tiny(request.param)


def test_streaming_grams_equal_direct_svd_of_stacked_vectors(arch_model):
    arch, model = arch_model
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    seqs = random_sequences(VOCAB, 3 * 2 * 24, 24, seed=0)  # 3 batches of 2 sequences
    grams = collect(model, adapter, seqs, batch=2, sink=GramSink())
    record = RecordSink()
    collect(model, adapter, seqs, batch=2, sink=record)
    heads = {"q": layout.num_heads, "k": layout.num_kv_heads, "v": layout.num_kv_heads, "o": layout.num_heads}
    for layer in range(layout.num_layers):
        for kind, h in heads.items():
            name = f"layers.{layer}.{kind}"
            x = record.stacked(name)  # [heads, N, d], captured vectors
            assert x.shape == (h, seqs.num_tokens, layout.head_dim)
            sv, vecs = svd_from_gram(grams[name])
            _, s, vh = torch.linalg.svd(x, full_matrices=False)
            torch.testing.assert_close(sv, s, rtol=1e-9, atol=1e-9)
            # vectors agree up to sign wherever singular values are well separated
            cos = (vecs * vh.transpose(1, 2)).sum(1).abs()  # [heads, d]
            gap = torch.minimum((s[:, :-1] - s[:, 1:]), torch.full_like(s[:, :-1], 1e9))
            distinct = torch.cat([gap[:, :1], torch.minimum(gap[:, 1:], gap[:, :-1])], 1) > 1e-3 * s[:, :1]
            assert distinct[:, :4].all()
            torch.testing.assert_close(cos[:, :-1][distinct], torch.ones_like(cos[:, :-1][distinct]),
                                       rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_taps_do_not_change_model_outputs(arch_model, impl):
    arch, model = arch_model
    model.set_attn_implementation(impl)  # eager runs the modeling file's own function (Gemma2 softcap)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with tapped(model, get_adapter(arch), lambda *a: None, lambda *a: None):
            during = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(during, before, rtol=0, atol=0)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert model.config._attn_implementation == impl
    model.set_attn_implementation("sdpa")


def _rope_matrix(model, attn_module, position: int, head_dim: int) -> torch.Tensor:
    """M such that RoPE at `position` of a row vector x is x @ M, built with the model's own code."""
    import sys

    rotary = model.base_model.rotary_emb
    eye = torch.eye(head_dim)[None, None]  # [1, 1, d, d]: d "tokens" at the same position
    pos = torch.full((1, head_dim), position)
    cos, sin = rotary(eye, pos)
    apply = sys.modules[type(attn_module).__module__].apply_rotary_pos_emb
    rotated, _ = apply(eye, eye, cos, sin)
    return rotated[0, 0]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_keys_are_captured_after_rope(arch):
    """Single-token sequences at position 0 and at position s: pre-RoPE keys and values are the same,
    so the key Gram must change exactly by the RoPE rotation, G_s = Mᵀ G_0 M, and V must not change."""
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    ids = torch.arange(32)[:, None] % VOCAB  # [32, 1]: 32 one-token sequences

    def grams_at(position: int) -> dict:
        sink = GramSink()

        def on_qkv(i, q, k, v):
            sink.add(f"{i}.k", k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1]))
            sink.add(f"{i}.v", v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[-1]))

        with tapped(model, adapter, on_qkv, lambda *a: None), torch.inference_mode():
            model.base_model(input_ids=ids, position_ids=torch.full_like(ids, position), use_cache=False)
        return sink.result()

    g0, gs = grams_at(0), grams_at(37)
    attn0 = adapter.attention_modules(model)[0]
    m = _rope_matrix(model, attn0, 37, layout.head_dim).to(torch.float64)
    for layer in range(layout.num_layers):
        k0, ks = g0[f"{layer}.k"], gs[f"{layer}.k"]
        assert not torch.allclose(k0, ks, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(ks, m.T @ k0 @ m, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gs[f"{layer}.v"], g0[f"{layer}.v"], rtol=1e-5, atol=1e-8)


def test_llama_keys_equal_an_independent_recomputation():
    """Captured keys of layer 1 = RoPE(k_proj(input_layernorm(h))) computed here from hidden states."""
    import transformers.models.llama.modeling_llama as ml

    model = build_tiny("LlamaForCausalLM")
    adapter = get_adapter("LlamaForCausalLM")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    record = RecordSink()

    def on_qkv(i, q, k, v):
        record.add(f"{i}.k", k)

    with tapped(model, adapter, on_qkv, lambda *a: None), torch.inference_mode():
        hidden = model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    layer = model.model.layers[1]
    with torch.inference_mode():
        x = layer.input_layernorm(hidden[1])
        k = layer.self_attn.k_proj(x).view(2, 12, -1, layer.self_attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(12)[None].expand(2, -1))
        _, k_rope = ml.apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(record.vectors["1.k"][0], k_rope.to(torch.float64), rtol=1e-5, atol=1e-6)


def test_rope_archs_listed():
    assert set(ROPE_ARCHS) == {a for a in TINY_CONFIGS if get_adapter(a).rope}


@pytest.mark.parametrize(("sinks", "window"), [(3, 4), (7, 3), (3, 0), (0, 30)])
def test_exact_recent_attention_reads_sinks_and_the_window_whole(sinks, window):
    """Against a per-query loop: query i reads key/value j from the whole tensors where j < sinks or i − j <
    window, else from the cached ones (GQA: 4 query heads over 2 KV heads), across row blocks; with no window, or
    one past the sequence, every query reads the same tokens whole (one attention call on a mixed cache)."""
    import kvfold.hooks as hooks

    g = torch.Generator().manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 23, 8
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k0, v0, k1, v1 = (torch.randn(b, hk, t, d, generator=g, dtype=torch.float64) for _ in range(4))
    rows, hooks._ROWS = hooks._ROWS, 5  # several row blocks
    try:
        got = hooks.exact_recent_attention(q, (k0, v0), (k1, v1), sinks=sinks, window=window, scaling=d ** -0.5)
    finally:
        hooks._ROWS = rows
    want = torch.zeros(b, t, h, d, dtype=torch.float64)
    for i in range(t):
        whole = [j < sinks or i - j < window for j in range(i + 1)]
        for head in range(h):
            kv = head // (h // hk)
            k = torch.stack([(k0 if w else k1)[:, kv, j] for j, w in enumerate(whole)], 1)
            v = torch.stack([(v0 if w else v1)[:, kv, j] for j, w in enumerate(whole)], 1)
            p = torch.softmax((q[:, head, i, None, :] * k).sum(-1) * d ** -0.5, -1)
            want[:, i, head] = (p[..., None] * v).sum(1)
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-5, atol=1e-6)  # its softmax is float32


def test_an_exact_window_over_the_whole_sequence_leaves_the_model_unchanged(arch_model):
    """A patch that ruins the cache, but whose window covers every token, changes nothing (to float32 rounding);
    with a window of one token (a query reads only itself whole) it changes the output."""
    from kvfold.hooks import AttentionPatch, patched

    arch, model = arch_model
    if getattr(model.config, "sliding_window", None) or getattr(model.config, "attn_logit_softcapping", None):
        pytest.skip("sliding-window and softcapped attention are refused by AttentionPatch.exact")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    layers = len(get_adapter(arch).attention_modules(model))

    def ruin(q, k, v):
        return q, k.flip(-1), -v

    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with patched(model, get_adapter(arch), dict.fromkeys(range(layers), AttentionPatch(ruin, exact=(0, 16)))):
            whole = model(input_ids=ids).logits
        with patched(model, get_adapter(arch), dict.fromkeys(range(layers), AttentionPatch(ruin, exact=(0, 1)))):
            ruined = model(input_ids=ids).logits
    torch.testing.assert_close(whole, before, rtol=1e-4, atol=1e-4)
    assert (ruined - before).abs().max() > 1e-2
