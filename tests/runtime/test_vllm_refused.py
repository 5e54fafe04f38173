"""A bad export in a real vLLM engine: refused by kvfold's plugin with one clear line naming the fix (a flipped byte,
a future schema, an edited rank, an unserved family, a bits export with fp8, a band table that its tensors contradict,
a windowed export with prefix caching on)."""

import hashlib
import json

import pytest

from tests.runtime.test_vllm import _prompts, _tampered, _windowed
from tests.runtime.vllm_engine import run_engine

pytestmark = pytest.mark.vllm


def _flip_byte(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _future_schema(folder):
    config = json.loads((folder / "config.json").read_text())
    config["kvfold"]["schema_version"] = "2.0"
    (folder / "config.json").write_text(json.dumps(config))
    manifest = json.loads((folder / "kvfold.json").read_text())
    manifest["schema_version"] = "2.0"
    (folder / "kvfold.json").write_text(json.dumps(manifest))


def _edited_rank(folder):
    manifest = json.loads((folder / "kvfold.json").read_text())
    manifest["d_k"][0][0] -= 1
    (folder / "kvfold.json").write_text(json.dumps(manifest))


def _band_table_off_by_a_dim(folder):
    """Layer 0, KV head 0 keeps one key dim fewer in config.json's band table (and ranks) than its tensors
    hold; config.json's sha256 in the manifest is updated, so only the tensors' shapes can tell."""
    config = json.loads((folder / "config.json").read_text())
    block = config["kvfold"]
    bits = block["k_bits"][0][0]
    bits[max(i for i, b in enumerate(bits) if b)] = 0
    block["d_k"][0][0] -= 1
    (folder / "config.json").write_text(json.dumps(config))
    manifest = json.loads((folder / "kvfold.json").read_text())
    manifest["d_k"], manifest["k_bits"] = block["d_k"], block["k_bits"]
    manifest["files"]["config.json"] = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    (folder / "kvfold.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("case", "expected"), [
    ("flipped byte", "model.safetensors differs from the manifest (sha256)"),
    ("future schema", "kvfold schema version '2.0' is not 1.x"),
    ("edited rank", "config.json's kvfold ranks differ from kvfold.json's"),
    ("gemma2", "kvfold's vLLM plugin does not serve KVFoldGemma2ForCausalLM exports"),
    ("bits with fp8", "kv_cache_dtype='fp8' would quantize those bytes again: serve it with kv_cache_dtype='auto'"),
    ("bits table vs tensors", "model.layers.0.self_attn.kvfold_k_post has shape [16, 28], config.json's kvfold band "
                              "table (k_bits / v_bits) gives [16, 27]"),
    ("windowed bits", "keeps each request's first 4 and last 64 tokens whole (windowed), which a prefix-cache hit "
                      "would skip: serve it with --no-enable-prefix-caching"),
])
def test_a_bad_export_is_refused_with_one_clear_line(tiny_exports, tiny_bits_exports, tmp_path, case, expected):
    base = tiny_exports["LlamaForCausalLM", "uneven"].path
    bits = tiny_bits_exports["LlamaForCausalLM"].path
    path = {"flipped byte": lambda: _tampered(base, tmp_path / "x", _flip_byte),
            "future schema": lambda: _tampered(base, tmp_path / "x", _future_schema),
            "edited rank": lambda: _tampered(base, tmp_path / "x", _edited_rank),
            "gemma2": lambda: tiny_exports["Gemma2ForCausalLM", "full"].path,
            "bits with fp8": lambda: bits,
            "bits table vs tensors": lambda: _tampered(bits, tmp_path / "x", _band_table_off_by_a_dim),
            "windowed bits": lambda: _tampered(bits, tmp_path / "x", _windowed)}[case]()
    # refuse() logs the line through vLLM's logger in whichever process builds the model: one case in the
    # processes `vllm serve` runs (the engine core's worker), the others in this one (~20 s less each)
    got = run_engine(path, _prompts(1), max_tokens=2, kv_cache_dtype="fp8" if case == "bits with fp8" else "auto",
                     own_processes=case == "flipped byte", engine_args={"enable_prefix_caching": True})
    assert "error" in got
    lines = [ln for ln in got["output"].splitlines() if "ERROR" in ln and "kvfold: " in ln]
    assert lines, got["output"][-3000:]
    assert expected in lines[0] and lines[0].count("\n") == 0
