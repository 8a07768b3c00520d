import pytest
import torch

from oscar_compile.rotation_math import (
    bit_reversal_order,
    bit_reversal_permutation,
    hadamard,
    orthogonality_error,
    oscar_rotation,
)


@pytest.mark.parametrize("d", [4, 12, 20, 24, 64, 80, 96, 128, 192, 256])
def test_hadamard_is_orthogonal_with_equal_magnitudes(d):
    h = hadamard(d).double()
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(h.abs(), torch.full_like(h, d**-0.5), atol=1e-6)


def test_hadamard_refuses_unsupported_sizes_clearly():
    with pytest.raises(NotImplementedError, match="112"):
        hadamard(112)


def test_bit_reversal_places_the_top_eigenvectors():
    order = bit_reversal_order(128)
    assert order[:4] == [0, 64, 32, 96]
    assert sorted(order) == list(range(128))
    eig = torch.rand(128)
    p = bit_reversal_permutation(eig)
    sigma = torch.argsort(eig, descending=True)
    for k, col in enumerate(order[:8]):
        assert p[sigma[k], col] == 1  # P[:, bitrev(k)] = e_sigma(k)
    assert torch.equal(p.sum(0), torch.ones(128)) and torch.equal(p.sum(1), torch.ones(128))


@pytest.mark.parametrize("d, group", [(128, 128), (128, 32), (128, 16), (64, 16), (96, 32)])
def test_every_group_gets_one_of_the_top_directions(d, group):
    num_groups = d // group
    top_channels = bit_reversal_order(d)[:num_groups]
    assert sorted(c // group for c in top_channels) == list(range(num_groups))


def _random_cov(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64) * torch.logspace(0, 2, d, dtype=torch.float64)
    return a @ a.T


@pytest.mark.parametrize("d", [64, 96, 128])
def test_oscar_rotation_is_orthogonal_and_equalises_the_diagonal(d):
    """Lemma 1: diag(R^T C R) = tr(C) / d for R = U H P."""
    cov = _random_cov(d)
    r, eigvals = oscar_rotation(cov)
    assert orthogonality_error(r) < 1e-5
    rotated = r.double().T @ cov @ r.double()
    expected = torch.full((d,), float(cov.trace()) / d, dtype=torch.float64)
    assert torch.allclose(torch.diagonal(rotated), expected, rtol=1e-4)
    assert torch.allclose(eigvals.double(), torch.linalg.eigvalsh(cov), rtol=1e-4, atol=1e-3)


def test_oscar_rotation_batches_over_heads():
    covs = torch.stack([_random_cov(32, s) for s in range(3)])
    r, eigvals = oscar_rotation(covs)
    assert r.shape == (3, 32, 32) and eigvals.shape == (3, 32)
    single, _ = oscar_rotation(covs[1])
    assert torch.allclose(r[1], single)
