"""Low-rank factorization by subspace (power) iteration with a warm start: pure tensor functions.

`factorize` is the PowerSGD-style step (Vogels et al. 2019) followed by a Rayleigh-Ritz rotation: after
P = orth(M Q) and Q' = M^T P we have M ~= P Q'^T, and the SVD of the small (n, r) matrix Q' turns that into
sorted singular triplets. Sorted triplets let a caller keep any leading subset (the adaptive rank) and give
singular-value estimates for free (the "small core" of the iteration), never a full SVD of a big matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Factors:
    """Rank-r approximation M ~= left @ diag(sigma) @ right.T with orthonormal columns, sigma descending.

    factors = factorize(matrix, warm_start)           # matrix: (m, n), warm_start: (n, r)
    approx = factors.left * factors.sigma @ factors.right.T
    next_warm_start = factors.right                   # (n, r)
    """

    left: torch.Tensor
    """(m, r) orthonormal columns."""
    sigma: torch.Tensor
    """(r,) singular-value estimates, descending (Ritz values: each <= the true singular value)."""
    right: torch.Tensor
    """(n, r) orthonormal columns; the warm start of the next round."""

    @property
    def rank(self) -> int:
        return self.sigma.numel()

    def truncate(self, rank: int) -> Factors:
        """The leading `rank` triplets (the best rank-`rank` approximation within this subspace)."""
        return Factors(self.left[:, :rank], self.sigma[:rank], self.right[:, :rank])

    def balanced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors to send, (r, m) and (r, n), each row scaled by sqrt(sigma) so that both have the same magnitude.

        Rows rather than columns: a quantization group then runs along one singular vector, whose entries share a
        scale, instead of mixing components of very different size.
        """
        root = self.sigma.sqrt()[:, None]  # (r, 1)
        return (self.left.T * root).contiguous(), (self.right.T * root).contiguous()


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """(m, r) with m >= r -> (m, r) orthonormal columns spanning the same space (reduced QR)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


def factorize(matrix: torch.Tensor, warm_start: torch.Tensor, *, iterations: int = 1) -> Factors:
    """Rank-r factors of `matrix` (m, n) from `iterations` subspace iterations started at `warm_start` (n, r).

    One iteration from last round's right vectors is enough when the pseudo-gradient's dominant subspace moves
    slowly between rounds; error feedback carries what it misses. An exactly rank-r matrix is recovered in one
    iteration from a generic start.
    """
    if iterations < 1:
        raise ValueError(f"compression.power_iterations = {iterations} must be >= 1")
    right = warm_start  # (n, r)
    for iteration in range(iterations):
        left = orthonormalize(matrix @ right)  # (m, r)
        projected = matrix.T @ left  # (n, r): matrix ~= left @ projected.T
        if iteration + 1 < iterations:
            right = orthonormalize(projected)
    # Rayleigh-Ritz: projected = U S Vh, so left @ projected.T = (left @ Vh.T) S U^T with sorted S.
    u, sigma, vh = torch.linalg.svd(projected, full_matrices=False)  # (n, r), (r,), (r, r)
    return Factors(left=left @ vh.T, sigma=sigma, right=u)


def randomized_factors(
    matrix: torch.Tensor,
    rank: int,
    *,
    oversample: int = 8,
    iterations: int = 2,
    generator: torch.Generator | None = None,
) -> Factors:
    """Randomized SVD (Halko et al. 2011) of `matrix` (m, n): the leading min(rank, m, n) triplets.

    Seeded through `generator` (the Gaussian start is drawn on the CPU) so that it never touches the global RNG,
    which the training loop's reproducibility depends on.
    """
    num_rows, num_cols = matrix.shape
    width = min(rank + oversample, num_rows, num_cols)
    start = torch.randn(num_cols, width, generator=generator, dtype=torch.float32).to(matrix)  # (n, width)
    return factorize(matrix, start, iterations=iterations).truncate(min(rank, width))
