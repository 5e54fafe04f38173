"""The calibration loop: feed batches through the model with taps on, route vectors into a sink."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvfold.adapters import Adapter, HeadLayout
from kvfold.calib.sinks import GramSink
from kvfold.calib.tokens import Sequences, batches
from kvfold.hooks import tapped

__all__ = ["collect"]


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, d] -> [H, B*T, d]"""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def collect(
    model: nn.Module,
    adapter: Adapter,
    seqs: Sequences,
    batch: int,
    sink=None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run every sequence through the model (once per sink pass) and return the sink's Grams."""
    sink = sink if sink is not None else GramSink()
    layout = HeadLayout.from_config(model.config)
    state = {"pass": 0}

    def on_qkv(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        p = state["pass"]
        sink.add(f"layers.{layer}.q", _per_head(q), p)
        sink.add(f"layers.{layer}.k", _per_head(k), p)
        sink.add(f"layers.{layer}.v", _per_head(v), p)

    def on_out(layer: int, o: torch.Tensor) -> None:
        b, t, _ = o.shape  # [B, T, H*d] -> [B, H, T, d]
        o = o.view(b, t, layout.num_heads, -1).transpose(1, 2)
        sink.add(f"layers.{layer}.o", _per_head(o), state["pass"])

    # The LM head is not needed for attention statistics; on SmolLM2 it is ~20% of the compute.
    body = model.base_model
    device = next(model.parameters()).device
    with tapped(model, adapter, on_qkv, on_out), torch.inference_mode():
        for p in range(sink.passes):
            state["pass"] = p
            for ids in batches(seqs, batch):
                body(input_ids=ids.to(device), use_cache=False)
                if on_batch is not None:
                    on_batch(ids.numel())
    return sink.result()
