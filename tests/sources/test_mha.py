"""The MHA variant (each KV head repeated for its query heads) computes exactly what the GQA model does."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfold.sources.embedded import expand_to_mha
from tests.conftest import ROPE_ARCHS, VOCAB


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_expand_to_mha_keeps_the_logits(tiny_dirs, tmp_path, arch):
    assert arch in ROPE_ARCHS
    expand_to_mha(tiny_dirs[arch], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 4
    gqa = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    mha = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert mha.config.num_key_value_heads == 4 and gqa.config.num_key_value_heads == 2
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = gqa(input_ids=ids).logits, mha(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert (tmp_path / "tokenizer.json").is_file()
