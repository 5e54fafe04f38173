"""The tiny frontier every frontier-method test scores on: a random Llama (GQA: 4 query / 2 KV heads, head_dim 16)."""

from __future__ import annotations

import pytest
import torch

from kvfold.hooks import patched
from kvfold_bench.frontier.patches import mapped_projections
from kvfold_bench.frontier.setup import Setup


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory) -> Setup:
    return Setup(str(tiny_dirs["LlamaForCausalLM"]), tmp_path_factory.mktemp("frontier"), eval_tokens=1024,
                 calib_tokens=1024, sensitivity_tokens=512, multiple=1)


def frontier_logits(setup: Setup, patches=None, proj_maps=None, model=None) -> torch.Tensor:
    """The logits of two scored windows with `patches` around attention and `proj_maps` on k/v_proj."""
    model = model or setup.model
    ids = torch.stack(setup.windows.ids[:2])
    with torch.inference_mode(), patched(model, setup.adapter, patches or {}), \
            mapped_projections(model, setup.adapter, proj_maps or {}):
        return model(input_ids=ids, use_cache=False).logits


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Whether `a` is within `tol` of `b`, relative to b's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max()) < tol
