"""A plain torch forward of baked weights, for the tests' exactness checks (not for serving: it pads;
the product measures exports as they are served, through kvfold-runtime).

The HF attention modules reshape projections with `head_dim`, so here each compressed projection is
wrapped to zero-pad every head back to head_dim (and o_proj to read only each head's kept dims).
Zero dims add nothing to q·k or to Σ p v, so the result is exactly the compressed model's; the
runtime package keeps the cache at the compressed widths instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from kvfold.adapters import Adapter, HeadLayout, get_adapter
from kvfold.checkpoint.manifest import Manifest
from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch, patched
from kvfold.rewrite.bake import make_projection
from kvfold_runtime import K_POST, K_SHIFT, Q_POST

__all__ = ["load_baked", "padded_forward"]


def _pad(x: torch.Tensor, widths: list[int], d: int) -> torch.Tensor:
    """[..., Σ widths] -> [..., len(widths)*d], each head's block zero-padded to d."""
    parts = x.split(widths, -1)
    return torch.cat([nn.functional.pad(p, (0, d - p.shape[-1])) for p in parts], -1)


class _PadOut(nn.Module):
    def __init__(self, inner: nn.Module, groups: list[list[int]], d: int) -> None:
        super().__init__()
        self.inner, self.groups, self.d = inner, groups, d  # groups: e.g. [[q widths], [k], [v]] when fused

    def forward(self, x):
        y = self.inner(x)
        parts = y.split([sum(g) for g in self.groups], -1)
        return torch.cat([_pad(p, g, self.d) for p, g in zip(parts, self.groups, strict=True)], -1)


class _TrimIn(nn.Module):
    def __init__(self, inner: nn.Module, widths: list[int], d: int) -> None:
        super().__init__()
        self.inner, self.widths, self.d = inner, widths, d

    def forward(self, x):  # [..., H*d] -> [..., Σ widths]
        heads = x.split(self.d, -1)
        return self.inner(torch.cat([h[..., :w] for h, w in zip(heads, self.widths, strict=True)], -1))


def _rope_patch(attn: nn.Module, dk_q: list[int], dk_kv: list[int], d: int) -> AttentionPatch:
    a_cols = getattr(attn, Q_POST).split(dk_q, 1)  # per query head [d, d_k]
    b_cols = getattr(attn, K_POST).split(dk_kv, 1)
    shift = getattr(attn, K_SHIFT, None)  # schema 1.8: subtracted from every key first

    def before(q, k, v):  # project right after RoPE, pad back to d for the HF attention call
        if shift is not None:
            k = k - shift.view(1, -1, 1, d)
        q = torch.stack([nn.functional.pad(q[:, h] @ a, (0, d - a.shape[1])) for h, a in enumerate(a_cols)], 1)
        k = torch.stack([nn.functional.pad(k[:, g] @ b, (0, d - b.shape[1])) for g, b in enumerate(b_cols)], 1)
        return q, k, v

    return AttentionPatch(before=before)


@contextmanager
def padded_forward(baked: nn.Module, adapter: Adapter, d_k: list[list[int]], d_v: list[list[int]]) -> Iterator:
    """Within the block, `baked` runs as a normal HF model."""
    layout = HeadLayout.from_config(baked.config)
    d, group = layout.head_dim, layout.num_heads // layout.num_kv_heads
    attns = adapter.attention_modules(baked)
    saved: list[tuple[nn.Module, str, nn.Module]] = []
    patches = {}
    for i, attn in enumerate(attns):
        q_w = [d_k[i][h // group] for h in range(layout.num_heads)] if not adapter.rope else [d] * layout.num_heads
        k_w = d_k[i] if not adapter.rope else [d] * layout.num_kv_heads
        v_w = d_v[i]
        wraps = {adapter.o_proj: _TrimIn(getattr(attn, adapter.o_proj),
                                         [v_w[h // group] for h in range(layout.num_heads)], d)}
        if adapter.qkv_fused:
            wraps[adapter.qkv_fused] = _PadOut(getattr(attn, adapter.qkv_fused), [q_w, k_w, v_w], d)
        else:
            for name, w in ((adapter.q_proj, q_w), (adapter.k_proj, k_w), (adapter.v_proj, v_w)):
                wraps[name] = _PadOut(getattr(attn, name), [w], d)
        for name, new in wraps.items():
            saved.append((attn, name, getattr(attn, name)))
            setattr(attn, name, new)
        if adapter.rope:
            patches[i] = _rope_patch(attn, [d_k[i][h // group] for h in range(layout.num_heads)], d_k[i], d)
    try:
        with patched(baked, adapter, patches):
            yield baked
    finally:
        for attn, name, orig in saved:
            setattr(attn, name, orig)


def load_baked(directory: Path) -> tuple[nn.Module, Adapter, Manifest]:
    """Load an exported directory into the source architecture's HF class, with every projection at
    its baked width (run it inside `padded_forward`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = Manifest.load(directory)
    adapter = get_adapter(manifest.source.architecture)
    config = AutoConfig.from_pretrained(directory)
    config.architectures = [manifest.source.architecture]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layout = HeadLayout.from_config(config)
    d, group, pl = layout.head_dim, layout.num_heads // layout.num_kv_heads, adapter.proj_layout
    for i, attn in enumerate(adapter.attention_modules(model)):
        dk_q = sum(manifest.d_k[i][h // group] for h in range(layout.num_heads))
        dv_q = sum(manifest.d_v[i][h // group] for h in range(layout.num_heads))
        widths = {"q": dk_q, "k": sum(manifest.d_k[i])} if not adapter.rope else \
            {"q": layout.num_heads * d, "k": layout.num_kv_heads * d}
        widths["v"] = sum(manifest.d_v[i])
        hidden = config.hidden_size

        def empty(n_in, n_out, like):
            return make_projection(torch.zeros(n_in, n_out), None if like.bias is None else torch.zeros(n_out), pl,
                         torch.float32)

        if adapter.qkv_fused:
            fused = getattr(attn, adapter.qkv_fused)
            setattr(attn, adapter.qkv_fused, empty(hidden, sum(widths.values()), fused))
        else:
            for kind, name in zip("qkv", (adapter.q_proj, adapter.k_proj, adapter.v_proj), strict=True):
                setattr(attn, name, empty(hidden, widths[kind], getattr(attn, name)))
        setattr(attn, adapter.o_proj, empty(dv_q, hidden, getattr(attn, adapter.o_proj)))
        if adapter.rope:
            attn.register_parameter(Q_POST, nn.Parameter(torch.zeros(d, dk_q), requires_grad=False))
            attn.register_parameter(K_POST, nn.Parameter(torch.zeros(d, sum(manifest.d_k[i])), requires_grad=False))
            if manifest.config_block().key_shift:
                shift = torch.zeros(layout.num_kv_heads * d)
                attn.register_parameter(K_SHIFT, nn.Parameter(shift, requires_grad=False))
    state = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        state |= load_file(f)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise KVFoldError(f"'{directory}' does not match its manifest (missing {sorted(set(missing) - tied)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}); re-export it")
    model.tie_weights()
    return model, adapter, manifest
