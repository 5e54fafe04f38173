"""A windowed bits export (issue 51): its first `sinks` and last `window` tokens read whole, the rest from their codes,
served by the transformers runtime as a decode at each position would read it."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvfold_runtime  # noqa: F401  (registers the KVFold classes)
from kvfold_runtime.format import ConfigBlock
from kvfold_runtime.hf.window_cache import WindowLayer
from kvfold_runtime.kernels.reference import reference_attention
from kvfold_runtime.kernels.torch_window import window_attention
from tests.conftest import VOCAB

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM"]  # full attention (a sliding-window model has no history to code)


def _windowed(export, tmp_path, sinks: int, window: int):
    """The export's files with config.json's block given `sinks` and `window`, loaded by the runtime."""
    out = tmp_path / f"s{sinks}w{window}"
    shutil.copytree(export.path, out)
    config = json.loads((out / "config.json").read_text())
    config["kvfold"] |= {"sinks": sinks, "window": window}
    (out / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(out).eval()


def _ids(seed: int, n: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [256, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_window_attention_reads_each_rows_window_whole(monkeypatch, rows, padded):
    """Query row i (at position S − T + i) reads key j whole where j < sinks or i − j < window, coded elsewhere:
    the reference attention run row by row on keys mixed that way is the oracle (GQA, uneven widths). In blocks of
    3 rows each block reads only the keys up to its last row's; with transformers' bool mask and the second
    sequence left-padded by 2 slots, its real rows read from slot 2 on and its padding rows stay finite."""
    import kvfold_runtime.kernels.torch_window as torch_window

    monkeypatch.setattr(torch_window, "_ROWS", rows)
    gen = torch.Generator().manual_seed(0)
    d_k, d_v, group, t, s, sinks, window, pad = [5, 3], [4, 6], 2, 7, 12, 2, 3, 2
    if padded:  # a prefill: the padding slots are query rows too
        t = s

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(2, t, group * sum(d_k))
    k0, k1, v0, v1 = rnd(2, s, sum(d_k)), rnd(2, s, sum(d_k)), rnd(2, s, sum(d_v)), rnd(2, s, sum(d_v))
    mask = None
    if padded:
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None, None].repeat(2, 1, 1, 1)
        mask[1, :, :, :pad] = False
    got = window_attention(q, k0, v0, k1, v1, d_k, d_v, group, scaling=0.3, sinks=sinks, window=window, mask=mask)
    assert got.isfinite().all()
    for b in range(2):
        first = pad if padded and b == 1 else 0
        for i in range(t):
            pos = s - t + i
            if pos < first:
                continue
            whole = torch.tensor([j < sinks or pos - j < window for j in range(first, pos + 1)])[None, :, None]
            k = torch.where(whole, k0[b:b + 1, first:pos + 1], k1[b:b + 1, first:pos + 1])
            v = torch.where(whole, v0[b:b + 1, first:pos + 1], v1[b:b + 1, first:pos + 1])
            want = reference_attention(q[b:b + 1, i:i + 1], k, v, d_k, d_v, group, scaling=0.3)
            torch.testing.assert_close(got[b:b + 1, i:i + 1], want)


@pytest.mark.parametrize("arch", ARCHS)
def test_windowed_export_decodes_as_its_full_forward(tiny_bits_exports, tmp_path, arch):
    """One forward over 20 tokens, and a prefill of 5 then a chunk of 4 then one token at a time through the
    DynamicCache, give the same logits: every position reads its window whole and the rest from the codes, whichever
    way the tokens arrive. The window changes them (the codes are coarse: 2–8 bits)."""
    served = _windowed(tiny_bits_exports[arch], tmp_path, sinks=2, window=4)
    plain = AutoModelForCausalLM.from_pretrained(tiny_bits_exports[arch].path).eval()
    ids = _ids(3)
    with torch.inference_mode():
        want = served(input_ids=ids, use_cache=False).logits
        cache = DynamicCache()
        steps = [served(input_ids=ids[:, :5], past_key_values=cache).logits,
                 served(input_ids=ids[:, 5:9], past_key_values=cache).logits]
        steps += [served(input_ids=ids[:, i:i + 1], past_key_values=cache).logits for i in range(9, 20)]
        other = plain(input_ids=ids, use_cache=False).logits
    assert all(isinstance(layer, WindowLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 20 and cache.layers[0].recent_k.shape[2] == 4
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-4, rtol=1e-4)
    assert (want[:, 6:] - other[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_a_window_past_the_sequence_reads_every_token_whole(tiny_exports, tiny_bits_exports, tmp_path, arch):
    """With the window longer than the sequence no token is read from its codes: the bits export then computes
    what the rank export of the same ranks and rotations computes (every kept dim whole), prefill and decode."""
    served = _windowed(tiny_bits_exports[arch], tmp_path, sinks=0, window=64)
    rank = AutoModelForCausalLM.from_pretrained(tiny_exports[arch, "uneven"].path).eval()
    ids = _ids(4)
    with torch.inference_mode():
        torch.testing.assert_close(served(input_ids=ids).logits, rank(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        got = served.generate(ids[:1, :6], max_new_tokens=12, do_sample=False)
        want = rank.generate(ids[:1, :6], max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_window_layer_keeps_its_whole_rows_through_cache_operations():
    """Beam reordering, repetition and selection move the whole rows with the codes; crop drops the rows it removes."""
    layer = WindowLayer(sinks=2, window=3)
    rows = torch.zeros(2, 1, 6, 4, dtype=torch.uint8)
    k = torch.arange(2 * 6 * 5, dtype=torch.float32).view(2, 1, 6, 5)
    layer.update(rows, rows)
    layer.keep(k, k + 1, 0)
    assert torch.equal(layer.whole_k, k[:, :, :2]) and torch.equal(layer.recent_k, k[:, :, 3:])
    assert layer.recent_start == 3
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.recent_k, k[[1, 0], :, 3:]) and torch.equal(layer.whole_v, k[[1, 0], :, :2] + 1)
    layer.crop(-2)
    assert layer.get_seq_length() == 4 and layer.recent_k.shape[2] == 1 and layer.recent_start == 3
    layer.batch_repeat_interleave(2)
    assert layer.recent_k.shape[0] == 4 and layer.whole_k.shape[0] == 4


def test_config_block_window_fields():
    """sinks / window round-trip through config.json's block (absent: 0), are refused on a rank export, and make
    the bytes per token depend on the context: every token's codes plus the whole rows."""
    base = {"schema_version": "1.10", "d_k": [[4]], "d_v": [[4]], "post_rope_projections": True,
            "k_bits": [[[4, 4, 4, 4]]], "v_bits": [[[4, 4, 4, 4]]], "band_scale": "log8"}
    block = ConfigBlock.from_dict(base | {"sinks": 4, "window": 60})
    assert (block.sinks, block.window, block.windowed) == (4, 60, True)
    assert ConfigBlock.from_dict(block.to_dict()) == block
    assert not ConfigBlock.from_dict(base).windowed and "window" not in ConfigBlock.from_dict(base).to_dict()
    coded = ConfigBlock.from_dict(base).bytes_per_token()
    assert block.bytes_per_token(context=128) == pytest.approx(coded + 16 * 64 / 128)
    assert block.bytes_per_token(context=32) == pytest.approx(coded + 16 * 36 / 32)  # 4 tokens held twice
    with pytest.raises(ValueError, match="context"):
        block.bytes_per_token()
    rank = {k: v for k, v in base.items() if k not in ("k_bits", "v_bits", "band_scale")}
    with pytest.raises(ValueError, match="bits-format"):
        ConfigBlock.from_dict(rank | {"window": 8})
