"""Rotation math (docs/design.md §3): Hadamard matrices, the bit-reversal placement, R = U · H · P_br.

Pure torch, no model knowledge. All results are d x d orthogonal float32 matrices acting on row
vectors: a rotated vector is ``x @ R``.
"""
from __future__ import annotations

import functools

import torch


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley1(q: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4)."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]  # Q[i, j] = chi(j - i), skew-symmetric
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1.0
    s[1:, 0] = -1.0
    s[1:, 1:] = jacobsthal
    return torch.eye(q + 1, dtype=torch.float64) + s


@functools.cache
def _hadamard64(d: int) -> torch.Tensor:
    if _is_power_of_two(d):
        return _sylvester(d)
    # d = 2^a * (q + 1) with q prime, q = 3 mod 4: Kronecker product of Sylvester and Paley I.
    two_power = 1
    while d % two_power == 0:
        m = d // two_power
        if _is_prime(m - 1) and (m - 1) % 4 == 3:
            return torch.kron(_sylvester(two_power), _paley1(m - 1))
        two_power *= 2
    raise NotImplementedError(
        f"no Hadamard construction for head_dim {d}: supported sizes are powers of two and "
        "2^a * (q + 1) with q a prime = 3 mod 4 (e.g. 12, 20, 24, 80, 96, 192); "
        "use rotation: none or oscar without a Hadamard for this model"
    )


def hadamard(d: int) -> torch.Tensor:
    """The normalised d x d Hadamard matrix (H @ H.T = I), float32.

    Sylvester's construction for powers of two; Sylvester x Paley I otherwise, which covers
    the head dims of current models (64, 80, 96, 128, 192, 256) but not, e.g., 112.
    """
    h = _hadamard64(d)
    return (h / d**0.5).to(torch.float32)


def bit_reverse(k: int, num_bits: int) -> int:
    return int(format(k, f"0{num_bits}b")[::-1], 2) if num_bits else 0


def bit_reversal_order(d: int) -> list[int]:
    """Channel that receives the k-th largest eigen-direction: bitrev(k) for powers of two.

    For other d the bit-reversed sequence over ceil(log2 d) bits is walked, skipping values >= d,
    which keeps the property that matters: the top directions land far apart, one per group.
    """
    num_bits = max(1, (d - 1).bit_length())
    order = [r for r in (bit_reverse(k, num_bits) for k in range(1 << num_bits)) if r < d]
    return order


def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """P_br with ``P[:, bitrev(k)] = e_sigma(k)``, sigma sorting ``eigenvalues`` descending.

    eigenvalues: [d]. Returns a float32 [d, d] permutation matrix.
    """
    d = eigenvalues.shape[-1]
    sigma = torch.argsort(eigenvalues.double(), descending=True, stable=True)
    p = torch.zeros(d, d, dtype=torch.float32)
    p[sigma, torch.tensor(bit_reversal_order(d))] = 1.0
    return p


def eigh_descending(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 eigen-decomposition of a symmetric [..., d, d]: (eigenvalues, U) as from torch.linalg.eigh."""
    cov64 = cov.double()
    cov64 = 0.5 * (cov64 + cov64.transpose(-1, -2))
    return torch.linalg.eigh(cov64)


def oscar_rotation(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R = U · H · P_br for each covariance in ``cov`` [..., d, d]. Returns (R float32, eigenvalues float32)."""
    eigvals, u = eigh_descending(cov)
    d = cov.shape[-1]
    h = hadamard(d).double()
    flat_vals, flat_u = eigvals.reshape(-1, d), u.reshape(-1, d, d)
    rots = [fu @ h @ bit_reversal_permutation(fv).double() for fv, fu in zip(flat_vals, flat_u, strict=True)]
    r = torch.stack(rots).reshape(cov.shape)
    return r.to(torch.float32), eigvals.to(torch.float32)


def identity_rotation(num_heads: int, d: int) -> torch.Tensor:
    return torch.eye(d).expand(num_heads, d, d).clone()


def hadamard_rotation(num_heads: int, d: int) -> torch.Tensor:
    return hadamard(d).expand(num_heads, d, d).clone()


def orthogonality_error(r: torch.Tensor) -> float:
    """max |R^T R - I| over a stack of matrices [..., d, d]."""
    r64 = r.double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r64.transpose(-1, -2) @ r64 - eye).abs().max())
