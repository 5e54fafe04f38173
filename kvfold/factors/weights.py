"""Read projection weights per head, whatever the layout (Linear [out, in] or GPT-2 Conv1D [in, out])."""

from __future__ import annotations

import torch
from torch import nn

from kvfold.adapters import Adapter, HeadLayout

__all__ = ["o_proj_heads"]


def o_proj_heads(model: nn.Module, adapter: Adapter, layer: int) -> torch.Tensor:
    """W_O split per query head: [H, d, hidden] in float64 on the CPU (where factors are computed), so
    that out = Σ_h o_h @ W_O[h]. A layer accelerate offloaded (--device-map) is read back for this."""
    from accelerate.utils import align_module_device

    layout = HeadLayout.from_config(model.config)
    o_proj = getattr(adapter.attention_modules(model)[layer], adapter.o_proj)
    with align_module_device(o_proj):  # a module in memory: left as it is
        w = o_proj.weight.detach().to("cpu", torch.float64)
    w_in_out = w if adapter.proj_layout == "conv1d" else w.T  # [H*d, hidden]
    return w_in_out.reshape(layout.num_heads, layout.head_dim, -1)
