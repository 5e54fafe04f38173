import pytest
import torch

from kvfold.calib.spectrum import dims_for_mass, rank_for_removal, svd_from_gram


@pytest.mark.parametrize(("r", "rank"), [(0.0, 4), (0.1, 3), (0.29, 3), (0.3, 2), (0.6, 1), (1.0, 0)])
def test_rank_for_removal_is_eq6(r, rank):
    sv = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)  # total 10
    assert rank_for_removal(sv, r) == rank


def test_dims_for_mass():
    sv = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    assert dims_for_mass(sv, 0.9) == 3
    assert dims_for_mass(sv, 1.0) == 4


def test_svd_from_gram_matches_direct_svd():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 8, generator=gen, dtype=torch.float64) @ torch.randn(8, 8, generator=gen,
                                                                              dtype=torch.float64)
    sv, vecs = svd_from_gram(x.T @ x)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(sv, s, rtol=1e-10, atol=1e-10)
    cos = (vecs * vh.T).sum(0).abs()  # columns equal up to sign
    torch.testing.assert_close(cos, torch.ones(8, dtype=torch.float64), rtol=1e-8, atol=1e-8)
