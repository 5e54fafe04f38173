import pytest

from kvfold.adapters import ADAPTERS, HeadLayout, get_adapter
from kvfold.errors import KVFoldError
from tests.conftest import TINY_CONFIGS, build_tiny


def test_every_adapter_has_a_tiny_model_row():
    assert set(ADAPTERS) == set(TINY_CONFIGS)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_adapter_finds_attention_projections(arch):
    model = build_tiny(arch)
    adapter = get_adapter(arch)
    layout = HeadLayout.from_config(model.config)
    attns = adapter.attention_modules(model)
    assert len(attns) == layout.num_layers
    for attn in attns:
        o_in_out = getattr(attn, adapter.o_proj).weight.shape  # W_O reads every query head's output
        if adapter.proj_layout == "linear":
            o_in_out = o_in_out[::-1]
        assert tuple(o_in_out) == (layout.num_heads * layout.head_dim, model.config.hidden_size)
        names = [adapter.qkv_fused] if adapter.qkv_fused else [adapter.q_proj, adapter.k_proj, adapter.v_proj]
        for name in names:
            proj = getattr(attn, name)
            assert (proj.bias is not None) >= adapter.qkv_bias  # adapters that promise biases have them


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(KVFoldError, match=r"unsupported architecture 'FooForCausalLM'.*LlamaForCausalLM"):
        get_adapter("FooForCausalLM")
