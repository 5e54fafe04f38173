"""research/passkey_split.py: the whole-token wrapper keeps exactly the first and last tokens of each head."""

from __future__ import annotations

import torch

from research.passkey_split import with_whole


def test_whole_tokens_are_given_back_exactly_and_the_rest_as_the_coder_gives_them():
    def coder(bands):
        return lambda x: torch.round(x * bands) / bands  # a coarse rounding, `bands` levels a unit

    x = torch.randn(2, 3, 10, 4)
    got = with_whole(coder, 2, 3)(4)(x)
    assert torch.equal(got[:, :, :2], x[:, :, :2]) and torch.equal(got[:, :, -3:], x[:, :, -3:])
    assert torch.equal(got[:, :, 2:-3], torch.round(x[:, :, 2:-3] * 4) / 4)
    assert not torch.equal(got, x)
    assert torch.equal(with_whole(coder, 1, 0)(4)(x)[:, :, 1:], torch.round(x[:, :, 1:] * 4) / 4)
