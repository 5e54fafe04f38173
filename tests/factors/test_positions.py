import pytest
import torch

from kvfold.factors.positions import position_average, rope_frequencies
from tests.conftest import TINY_CONFIGS, build_tiny

ROPE_ARCHS = sorted(a for a in TINY_CONFIGS if a not in ("GPT2LMHeadModel", "OPTForCausalLM"))


def _post_rope(model, x: torch.Tensor, positions: torch.Tensor, layer_type: str | None) -> torch.Tensor:
    """x [N, d] turned at `positions` [N] by the model's own rotary embedding and transformers'
    apply_rotary_pos_emb (angles in float32: ~1e-7 relative)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
    args = (layer_type,) if hasattr(rotary, f"{layer_type}_inv_freq") else ()  # per-type rotary (Gemma3)
    cos, sin = rotary(x[None], positions[None], *args)
    q = x[None, None]  # [1, 1, N, d]
    out, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return out[0, 0]


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_position_average_is_the_gram_of_every_shift(arch):
    """The closed form equals the Gram of the same vectors re-embedded at every shift s ∈ [0, C), through each
    architecture's own rotary embedding (so the pairing convention and the frequencies are the model's)."""
    model = build_tiny(arch).double()
    freqs = rope_frequencies(model, model.config.num_hidden_layers)
    types = getattr(model.config, "layer_types", None) or [None] * model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    for layer in sorted({0, model.config.num_hidden_layers - 1}):
        d = freqs[layer].numel() * 2
        x = torch.randn(200, d, generator=gen, dtype=torch.float64) @ torch.randn(d, d, generator=gen,
                                                                                 dtype=torch.float64)
        t = torch.randint(0, 32, (200,), generator=gen)
        post = _post_rope(model, x, t, types[layer])
        gram = post.T @ post
        context = 45
        shifted = sum(_post_rope(model, x, t + s, types[layer]).T @ _post_rope(model, x, t + s, types[layer])
                      for s in range(context)) / context
        assert torch.allclose(position_average(gram, freqs[layer], context), shifted, atol=1e-6 * shifted.abs().max())


def test_position_average_keeps_fast_planes_and_the_trace():
    """Planes that turn fully within the context lose their orientation; the trace (the energy) is unchanged;
    a context of 1 changes nothing."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    gram = x.T @ x
    freqs = torch.tensor([1.0, 0.1, 1e-3, 1e-6], dtype=torch.float64)
    avg = position_average(gram, freqs, 100_000)
    assert torch.allclose(position_average(gram, freqs, 1), gram, atol=1e-12)
    assert torch.trace(avg) == pytest.approx(torch.trace(gram).item(), rel=1e-12)
    plane0 = avg[[0, 4]][:, [0, 4]]  # ω = 1 rad per token: averaged to an isotropic 2×2 block
    assert torch.allclose(plane0, torch.eye(2, dtype=torch.float64) * plane0.trace() / 2, atol=1e-3 * plane0.trace())
    plane3 = avg[[3, 7]][:, [3, 7]]  # ω = 1e-6: turns 0.1 rad over the context, nearly as measured
    assert torch.allclose(plane3, gram[[3, 7]][:, [3, 7]], rtol=0.05)


def test_partial_rotary_is_refused():
    with pytest.raises(ValueError, match="partial rotary"):
        position_average(torch.eye(8, dtype=torch.float64), torch.ones(2, dtype=torch.float64), 10)
