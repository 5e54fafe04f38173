"""plan.stored.banded's nudged roundings (plan/longrange.py's draws of a quantized cache)."""

import pytest
import torch

from kvfold.measure.stored import banded
from kvfold_runtime import bands_from_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nudged_roundings_differ_in_every_dtype(dtype):
    """Each nudge flips some codes at level boundaries, in bfloat16 too (where x·(1 + 1e-4) alone is x), and hands
    back the cache's dtype. (1e-4, not the check's 1e-6: at 1e-6 about one value in 10⁵ flips, too few in a tensor
    this small; a real cache holds ~10⁸.)"""
    x = torch.randn(1, 2, 4096, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    bands = [bands_from_bits([4] * 8 + [2] * 8)] * 2
    plain, up, down = (banded(bands, nudge)(x) for nudge in (0.0, 1e-4, -1e-4))
    assert plain.dtype == up.dtype == down.dtype == dtype
    assert not torch.equal(plain, up) and not torch.equal(plain, down) and not torch.equal(up, down)
    assert (plain != up).float().mean() < 0.01  # a few flips, not another cache
