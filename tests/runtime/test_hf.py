"""Exports served through transformers by kvfold_runtime: exact at full rank, the compressed model at
uneven ranks, a cache that really holds the compressed widths."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import kvfold_runtime
from tests.conftest import TINY_CONFIGS, VOCAB
from tests.reference import load_baked, padded_forward

ARCHS = sorted(TINY_CONFIGS)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _ids(seed, shape=(2, 24)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _eager(model):
    model.set_attn_implementation("eager")  # Gemma 2's soft-capping exists only in eager attention
    return model


def _serve(export):
    return AutoModelForCausalLM.from_pretrained(export.path).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_export_reproduces_the_original(tiny_exports, arch):
    export = tiny_exports[arch, "full"]
    original, served = _eager(export.original), _serve(export)
    assert type(served).__name__ == f"KVFold{arch}"
    ids = _ids(1)
    with torch.inference_mode():
        assert _rel(served(input_ids=ids).logits, original(input_ids=ids).logits) < 1e-5
        # 40 new tokens: past the tiny models' sliding window (16), all through the cache
        want = original.generate(ids[:1, :6], max_new_tokens=40, do_sample=False)
        got = served.generate(ids[:1, :6], max_new_tokens=40, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_uneven_export_computes_the_baked_model(tiny_exports, arch):
    """kvfold's padded reference forward of the same files is the oracle; the runtime must agree
    in one pass, in incremental decoding, and with a left-padded batch."""
    export = tiny_exports[arch, "uneven"]
    served = _serve(export)
    baked, adapter, m = load_baked(export.path)
    ids = _ids(2)
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    with torch.inference_mode(), padded_forward(_eager(baked), adapter, m.d_k, m.d_v):
        want = baked(input_ids=ids).logits
        want_padded = baked(input_ids=ids, attention_mask=pad).logits
    with torch.inference_mode():
        assert _rel(served(input_ids=ids).logits, want) < 1e-5
        assert _rel(want, export.original(input_ids=ids).logits) > 1e-3  # compression changed something
        cache = DynamicCache(config=served.config)
        first = served(input_ids=ids[:, :10], past_key_values=cache).logits  # prefill
        chunk = served(input_ids=ids[:, 10:20], past_key_values=cache).logits  # chunked prefill, T < S
        steps = [served(input_ids=ids[:, i : i + 1], past_key_values=cache).logits for i in range(20, 24)]
        assert _rel(torch.cat([first, chunk, *steps], 1), want) < 1e-5
        got_padded = served(input_ids=ids, attention_mask=pad).logits
        assert _rel(served(input_ids=ids, past_key_values=DynamicCache()).logits, want) < 1e-5  # no config
    assert _rel(got_padded[:, 5:], want_padded[:, 5:]) < 1e-5


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel", "Gemma3ForCausalLM"])
def test_cache_holds_the_compressed_widths(tiny_exports, arch):
    export = tiny_exports[arch, "uneven"]
    served, m = _serve(export), export.manifest
    ids = _ids(3, (3, 12))
    with torch.inference_mode():
        cache = served(input_ids=ids, use_cache=True).past_key_values
        full = export.original(input_ids=ids, use_cache=True).past_key_values
    for layer, d_k, d_v in zip(cache.layers, m.d_k, m.d_v, strict=True):
        assert layer.keys.shape == (3, 1, 12, sum(d_k)) and layer.values.shape == (3, 1, 12, sum(d_v))
    ratio = kvfold_runtime.kv_cache_bytes(cache) / kvfold_runtime.kv_cache_bytes(full)
    assert ratio == pytest.approx(1 - m.chosen.compression, abs=1e-12) and ratio < 1


def test_plain_checkpoints_still_load_as_their_own_class(tiny_dirs):
    assert type(AutoModelForCausalLM.from_pretrained(tiny_dirs["LlamaForCausalLM"])) is LlamaForCausalLM
    assert type(AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, hidden_size=32,
                                                             intermediate_size=32))) is LlamaForCausalLM
    kvfold_runtime.register()  # idempotent
    assert type(AutoModelForCausalLM.from_pretrained(tiny_dirs["LlamaForCausalLM"])) is LlamaForCausalLM


def test_a_config_without_the_kvfold_block_is_refused(tiny_dirs):
    config = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32)
    with pytest.raises(ValueError, match="not a kvfold export"):
        kvfold_runtime.runtime_class("LlamaForCausalLM")(config)


def test_generate_with_the_usual_arguments(tiny_exports):
    """Beam search (the cache is reordered), sampling, and a left-padded batch, at full rank against
    the original and at uneven ranks for shape and determinism."""
    export = tiny_exports["LlamaForCausalLM", "full"]
    original, served = export.original, _serve(export)
    ids = _ids(4, (2, 8))
    pad = torch.ones_like(ids)
    pad[1, :3] = 0
    common = dict(attention_mask=pad, max_new_tokens=12, pad_token_id=256)
    with torch.inference_mode():
        assert torch.equal(served.generate(ids, num_beams=3, do_sample=False, **common),
                           original.generate(ids, num_beams=3, do_sample=False, **common))
        torch.manual_seed(0)
        want = original.generate(ids, do_sample=True, top_k=20, temperature=0.8, **common)
        torch.manual_seed(0)
        assert torch.equal(served.generate(ids, do_sample=True, top_k=20, temperature=0.8, **common), want)
        uneven = _serve(tiny_exports["LlamaForCausalLM", "uneven"])
        out = uneven.generate(ids, num_beams=2, do_sample=False, **common)
    assert out.shape == (2, 20)


def test_a_static_cache_is_refused_with_the_fix(tiny_exports):
    served = _serve(tiny_exports["LlamaForCausalLM", "uneven"])
    with pytest.raises(ValueError, match="remove cache_implementation"), torch.inference_mode():
        served.generate(_ids(5, (1, 6)), max_new_tokens=3, cache_implementation="static")


def _as_before_schema_1_6(export) -> None:
    """An export written before schema 1.6: float16 band scales, and no `band_scale` in config.json."""
    path = export.path / "config.json"
    config = json.loads(path.read_text())
    assert config["kvfold"].pop("band_scale") == "float16"
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(("arch", "scale"), [("LlamaForCausalLM", "log8"), ("GPT2LMHeadModel", "log8"),
                                             ("LlamaForCausalLM", "float16")])
def test_a_bits_format_cache_stores_the_band_codes_and_attends_to_them(tiny_dirs, tmp_path, arch, scale):
    from kvfold_runtime.bands import bands_from_bits as bands_at
    from kvfold_runtime.bands import decode_heads, roundtrip, row_bytes
    from tests.runtime.conftest import write_export

    def bands_from_bits(h):
        return bands_at(h, scale)

    plain = write_export(arch, tiny_dirs[arch], tmp_path / "plain", "uneven")
    wide = write_export(arch, tiny_dirs[arch], tmp_path / "16", "uneven", bits="16", band_scale=scale)
    low = write_export(arch, tiny_dirs[arch], tmp_path / "low", "uneven", bits="low", band_scale=scale)
    if scale == "float16":  # older exports still load, and their cache reads the float16 scales they stored
        _as_before_schema_1_6(low)
    ids = _ids(4, (2, 20))
    with torch.inference_mode():
        want = _serve(plain)(input_ids=ids).logits
        # 16-bit bands: float16 storage of the same k', v'
        assert _rel(_serve(wide)(input_ids=ids).logits, want) < 1e-3
        served = _serve(low)
        one_pass = served(input_ids=ids, use_cache=False).logits
        assert _rel(one_pass, want) > 1e-3  # 2–8 bits change something
        # per-token scales: a token's codes depend on that token alone, so decoding token by token stores
        # what one pass stores — up to float round-off of k' itself, which flips a rare code at a rounding
        # boundary (measured: ≤ ~1% of a layer's bytes) and moves those positions' logits
        cache = DynamicCache(config=served.config)
        steps = [served(input_ids=ids[:, :8], past_key_values=cache).logits]
        steps += [served(input_ids=ids[:, i : i + 1], past_key_values=cache).logits for i in range(8, 20)]
        whole = served(input_ids=ids, use_cache=True).past_key_values
        same = [float((a.keys == b.keys).float().mean()) for a, b in zip(whole.layers, cache.layers, strict=True)]
        assert min(same) > 0.97 and same[0] == 1.0  # layer 0's k' is computed from the embeddings alone
        diff = (torch.cat(steps, 1) - one_pass).abs().amax(-1)  # [B, T]
        assert float(diff[:, :8].max()) < 1e-4 and float(diff.median()) < 1e-4
        plain_cache = _serve(plain)(input_ids=ids, use_cache=True).past_key_values
    m = low.manifest
    # layer 0 sees the same input in both exports: its cache holds the codes of the plain export's k', v'
    k0, v0 = plain_cache.layers[0].keys, plain_cache.layers[0].values  # [B, 1, T, Σ d]
    for rows, plain_rows, widths, bits in ((whole.layers[0].keys, k0, m.d_k[0], m.k_bits[0]),
                                           (whole.layers[0].values, v0, m.d_v[0], m.v_bits[0])):
        bands = tuple(bands_from_bits(h) for h in bits)
        decoded = decode_heads(rows, tuple(widths), bands, torch.float32)
        want_rows = torch.cat([roundtrip(x, b) for x, b in zip(plain_rows.split(widths, -1), bands, strict=True)], -1)
        assert torch.allclose(decoded, want_rows, atol=1e-6)
    for layer, kb, vb in zip(cache.layers, m.k_bits, m.v_bits, strict=True):
        per_token = (sum(row_bytes(bands_from_bits(h)) for h in kb), sum(row_bytes(bands_from_bits(h)) for h in vb))
        assert layer.keys.dtype == torch.uint8 and layer.keys.shape == (2, 1, 20, per_token[0])
        assert layer.values.shape == (2, 1, 20, per_token[1])
    assert kvfold_runtime.kv_cache_bytes(cache) == 2 * 20 * sum(
        row_bytes(bands_from_bits(h)) for side in (m.k_bits, m.v_bits) for layer in side for h in layer)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_16_bit_bands_at_full_rank_are_exact_in_a_float16_model(tiny_dirs, tmp_path, arch):
    """16-bit bands store float16: in a float16 model they give back k' and v' bit for bit, so the banded
    full-rank export computes exactly what the plain full-rank export computes (which reproduces the
    original: test_full_rank_export_reproduces_the_original). In a float32 model they round k', v' to
    float16 (the other test above)."""
    from tests.runtime.conftest import write_export

    plain = write_export(arch, tiny_dirs[arch], tmp_path / "plain", "full")
    wide = write_export(arch, tiny_dirs[arch], tmp_path / "16", "full", bits="16")
    ids = _ids(5, (2, 16))
    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(plain.path, dtype=torch.float16).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(wide.path, dtype=torch.float16).eval()(input_ids=ids).logits
    assert torch.equal(got, want)


def test_the_key_shift_is_subtracted_before_the_post_rope_projection(tiny_dirs, tmp_path):
    """An export with a key shift s (format.K_SHIFT) caches k' = (k − s_g) B_g: the same model without it caches
    k B_g, so the two caches differ by s_g B_g in every row — and the logits, which softmax keeps blind to the
    shift, do not."""
    from kvfold_runtime import K_POST, K_SHIFT
    from tests.runtime.conftest import write_export

    arch = "LlamaForCausalLM"
    plain = write_export(arch, tiny_dirs[arch], tmp_path / "plain", "uneven")
    shifted = write_export(arch, tiny_dirs[arch], tmp_path / "shifted", "uneven", key_shift=True)
    ids = _ids(6, (2, 12))
    with torch.inference_mode():
        model = _serve(shifted)
        got = model(input_ids=ids, use_cache=True)
        want = _serve(plain)(input_ids=ids, use_cache=True)
        assert _rel(got.logits, want.logits) < 1e-5
        m = shifted.manifest
        for i, (a, b) in enumerate(zip(got.past_key_values.layers, want.past_key_values.layers, strict=True)):
            attn = model.model.layers[i].self_attn
            shift = getattr(attn, K_SHIFT).view(len(m.d_k[i]), -1)  # [H_kv, d]
            cols = getattr(attn, K_POST).split(m.d_k[i], 1)
            moved = torch.cat([s @ c for s, c in zip(shift, cols, strict=True)])  # [Σ d_k]
            assert float(moved.abs().max()) > 1.0
            torch.testing.assert_close(b.keys - a.keys, moved.expand_as(a.keys), atol=1e-4, rtol=1e-4)
